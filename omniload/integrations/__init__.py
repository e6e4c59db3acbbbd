"""omniload inside the trainers people already run; docs/recipes.md shows each in a script.

- `batches`: the rank Loader as a torch IterableDataset, the step a checkpoint must save,
  labels in the Hugging Face convention. Needs torch only.
- `hf`: a Hugging Face `Trainer` that reads the Loader per rank (accelerate does not re-shard
  it) and keeps the loader position in the Trainer's checkpoints. Needs transformers.
- `lightning`: a `LightningDataModule` whose state is the loader position. Needs pytorch_lightning.
- `torchtitan`: a torchtitan `BaseDataLoader` (Stateful) over the Loader. Needs torchtitan.

Each framework module imports its framework at the top: import it only where the framework is
installed. None of them is imported by `import omniload`.
"""
