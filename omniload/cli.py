"""`omniload launch | serve | relay | demo | ...`.

Every spec option maps onto one `Spec` field (same name in `--config` files, also settable as
OMNILOAD_<NAME>); a flag given on the command line overrides the file.
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import click

from omniload.errors import ConfigError, OmniloadError
from omniload.spec import (
    BROADCAST_AT,
    CP_SPLITS,
    GROUP_OF,
    GROUPS,
    LONG_CHATS,
    LONG_DOCS,
    ON_BAD_FILE,
    PP_DATA,
    RANK_TOKENS,
    Spec,
    load_config,
    parse_source,
)

_DEFAULTS = {f.name: f.default for f in dataclasses.fields(Spec) if f.name != "sources"}
_CHILD_STOP_S = 10.0
_PROGRESS_S = 30.0

_SPEC_OPTIONS: list[tuple[str, dict[str, Any]]] = [  # (flag, click's kwargs); --help groups them by spec.GROUPS
    ("--seq-len", dict(type=int, help="Tokens per row.")),
    ("--rows", dict(type=int, help="Rows per batch on each data-parallel rank.")),
    (
        "--tokenizer",
        dict(
            help="'bytes', a tokenizer.json path, module:function, or a Hugging Face Hub model id ORG/NAME[@REVISION]."
        ),
    ),
    (
        "--workers",
        dict(
            type=lambda v: 0 if str(v) == "auto" else int(v),
            metavar="N|auto",
            help="Total source-worker processes, split among sources by weight once; auto (or 0): up to "
            "the CPUs less --reserve-cpus, starting with one and growing while sources starve, "
            "re-split online by each source's measured cost per token.",
        ),
    ),
    (
        "--reserve-cpus",
        dict(type=int, help="With --workers auto: CPUs left to the ranks and the coordinator."),
    ),
    (
        "--autoscale-every",
        dict(
            type=float,
            help="With --workers auto: seconds between decisions to grow, shrink or re-split the pool "
            "(0: the budget's workers, split by weight once).",
        ),
    ),
    ("--seed", dict(type=int, help="Seed of every shuffle: same seed, spec and files give the same batches.")),
    ("--epochs", dict(type=int, help="Passes over each source (0: repeat forever, reshuffled).")),
    ("--steps", dict(type=int, help="Stop after this many steps (0: when the data ends).")),
    ("--tp", dict(type=int, help="Tensor-parallel size.")),
    ("--pp", dict(type=int, help="Pipeline-parallel size.")),
    ("--cp", dict(type=int, help="Context-parallel size.")),
    (
        "--cp-split",
        dict(
            type=click.Choice(CP_SPLITS),
            help="With --cp > 1: cut every packed sequence into 2*cp chunks (Transformer Engine's THD "
            "layout, with cu_seqlens_padded) or every row (padded BSHD rows).",
        ),
    ),
    (
        "--on-bad-file",
        dict(type=click.Choice(ON_BAD_FILE), help="Stop the job at an unreadable file, or skip it."),
    ),
    ("--ring-mb", dict(type=int, help="Shared-memory ring size per worker lane, in MB.")),
    ("--plan-ahead", dict(type=int, help="Steps planned ahead of the slowest rank.")),
    ("--max-restarts", dict(type=int, help="Restarts of a crashed worker before the job fails.")),
    (
        "--worker-timeout",
        dict(type=float, help="Seconds without a sample from a source before the job fails."),
    ),
    (
        "--rank-timeout",
        dict(
            type=float,
            help="Seconds a rank the others wait for may stay silent (no ACK, or "
            "disconnected) before the job fails naming it; a rank that has not "
            "connected yet is only named (0: wait forever).",
        ),
    ),
    (
        "--metrics-port",
        dict(
            type=int, help="Serve Prometheus metrics at http://HOST:PORT/metrics (0: any free port; the log names it)."
        ),
    ),
    (
        "--senders",
        dict(
            type=int,
            help="Processes that write batches to the ranks' sockets from shared memory "
            "(0: the coordinator itself; -1: one per 64 connecting ranks, at most one per 8 cores; none with relays).",
        ),
    ),
    ("--balance", dict(help="Cost model for balancing ranks: tokens, attention, or module:function.")),
    ("--cost-coeffs", dict(help="a,b,c[,d] of the attention cost a*len^2 + b*len + c + d*images.")),
    (
        "--cost-model",
        dict(
            help="The model's shape, layers=L,hidden=H,heads=N,ffn=F,vocab=V[,kv_heads=K], or a preset "
            "(llama-1b, llama-8b, llama-70b): sets the attention cost from its training FLOPs."
        ),
    ),
    (
        "--rank-tokens",
        dict(
            type=click.Choice(RANK_TOKENS),
            help="fixed: every rank gets rows x seq-len tokens; variable: each rank its own number of "
            "tokens as one packed sequence, so that rank costs are equal.",
        ),
    ),
    (
        "--max-rank-tokens",
        dict(type=int, help="With --rank-tokens variable: most tokens of a rank's sequence (0: 2 x rows x seq-len)."),
    ),
    (
        "--pad-to",
        dict(type=int, help="With --rank-tokens variable: pad a rank's sequence to a multiple of this."),
    ),
    ("--image-size", dict(help="HxW every image is resized and center-cropped to (sources with images).")),
    (
        "--image-transform",
        dict(help="module:function from a PIL image to uint8 [3, H, W], instead of resize-and-crop."),
    ),
    (
        "--image-token",
        dict(type=int, help="Placeholder token id of an image (needed when a source has images)."),
    ),
    ("--tokens-per-image", dict(type=int, help="Placeholder tokens per image in input_ids.")),
    ("--balance-window", dict(type=int, help="Steps a hard-to-place document may wait for a better step.")),
    (
        "--long-docs",
        dict(
            type=click.Choice(LONG_DOCS),
            help="Documents longer than seq-len: split into chunks, drop, or keep whole rows together.",
        ),
    ),
    (
        "--long-chats",
        dict(
            type=click.Choice(LONG_CHATS),
            help="Conversations (kind=chat) longer than seq-len: cut after the last whole turn that fits, or drop.",
        ),
    ),
    (
        "--shuffle-window",
        dict(
            type=int,
            help="The job's shuffle horizon in segments of seq-len tokens, split among sources "
            "by weight: each unit waits a seeded share of it, a long document's chunks spread "
            "evenly over it (0: 2**28 tokens, at least 64 global batches).",
        ),
    ),
    (
        "--shuffle-fill",
        dict(
            type=int,
            help="Segments of seq-len tokens of each epoch read before its first draw, split among sources by "
            "weight: an epoch within it is a global shuffle; less makes the first batch come sooner "
            "(0: 2**27 tokens, at least 16 global batches, at most the horizon).",
        ),
    ),
    (
        "--shuffle-dir",
        dict(
            metavar="PATH",
            help="Local disk where documents wait for the shuffle (about the horizon's tokens "
            "at 2-4 bytes each); the system's temporary folder when unset.",
        ),
    ),
    (
        "--max-doc-share",
        dict(type=float, help="Most of one rank's tokens a single document may fill in a step (at least one chunk)."),
    ),
    (
        "--shard-interleave",
        dict(type=int, help="Shards each source reads at once, taking their rows in turn."),
    ),
    ("--rank-order", dict(help="Order of the parallel axes in the rank number, fastest first.")),
    (
        "--pp-data",
        dict(type=click.Choice(PP_DATA), help="Pipeline stages that receive data."),
    ),
    (
        "--broadcast-at",
        dict(
            type=click.Choice(BROADCAST_AT),
            help="tp: one rank per tensor-parallel group connects and broadcasts to the others.",
        ),
    ),
    ("--checkpoint-dir", dict(help="Folder for loader snapshots and the per-step delta log.")),
    (
        "--snapshot-every",
        dict(type=int, help="Steps between full snapshots; a resume replays at most this many steps."),
    ),
    (
        "--keep-snapshots",
        dict(type=int, help="Snapshots kept in --checkpoint-dir (older ones and their logs are removed)."),
    ),
    ("--resume", dict(help="Checkpoint folder to resume from when the ranks bring no loader state.")),
    (
        "--allow-changed-data",
        dict(is_flag=True, help="Resume even if the spec or files changed (recorded in the log)."),
    ),
    (
        "--read-ahead",
        dict(
            metavar="BYTES",
            help="Bytes of a store's objects each worker lane holds, fetched ahead "
            "of its reads and kept for re-reads (e.g. 64MB).",
        ),
    ),
    (
        "--cache-dir",
        dict(
            metavar="PATH|auto",
            help="Keep blocks of a store's objects on local disk here, for re-reads, "
            "epoch 2 and the next job (auto: $XDG_CACHE_HOME/omniload); off "
            "when unset.",
        ),
    ),
    (
        "--cache-limit",
        dict(metavar="BYTES", help="Bytes --cache-dir may hold; least recently used blocks go first."),
    ),
]


# the sections of launch's and serve's --help, in this order (then the command's other options)
_GROUPS = list(GROUPS)


class _GroupedOption(click.Option):
    """An option that names its section of --help (one of _GROUPS)."""

    def __init__(self, *args: Any, group: str, **kwargs: Any) -> None:
        if group not in _GROUPS:
            raise ValueError(f"unknown option group {group!r}; groups: {', '.join(_GROUPS)}")
        super().__init__(*args, **kwargs)
        self.group = group


class _GroupedCommand(click.Command):
    """A command whose --help lists its options in one section per group, then the rest (click's
    own format_options, section by section)."""

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        sections: dict[str, list[tuple[str, str]]] = {}
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx)
            if record is not None and not isinstance(param, click.Argument):
                sections.setdefault(getattr(param, "group", ""), []).append(record)
        for group in [*_GROUPS, ""]:
            if sections.get(group):
                with formatter.section(group.capitalize() or "Options"):
                    formatter.write_dl(sections[group])


def spec_options(command: Callable) -> Callable:
    for flag, kwargs in reversed(_SPEC_OPTIONS):
        field = flag[2:].replace("-", "_")
        group = GROUP_OF[field]
        kwargs = dict(kwargs, default=None, envvar=f"OMNILOAD_{field.upper()}")
        kwargs["help"] = f"{kwargs['help']}  [default: {_DEFAULTS[field]}]"
        command = click.option(flag, field, cls=_GroupedOption, group=group, **kwargs)(command)
    command = click.option(
        "--source",
        "sources",
        multiple=True,
        metavar="NAME=GLOB[,weight=W][,column=C]",
        cls=_GroupedOption,
        group="data",
        help="A data source; repeat for several. GLOB is a local glob or a URL (s3://, gs://, "
        "az://, hf://). Options: weight, column, format, tokenizer, epochs; image (the column of "
        "encoded images); tokens, dtype, eos, vocab (token ids, docs/sources.md); kind=chat, "
        "train_on (conversations); endpoint, region, anonymous (for a store); manifest (a file "
        "`omniload index` wrote: nothing is listed).",
    )(command)
    return click.option(
        "--config",
        "config",
        type=click.Path(dir_okay=False),
        cls=_GroupedOption,
        group="data",
        help="YAML/JSON file with the same options; flags override it.",
    )(command)


def build_spec(config: str | None, sources: tuple[str, ...], options: dict[str, Any]) -> Spec:
    data = load_config(config) if config else {}
    where = f"config file {config!r}" if config else "flags"
    if sources:
        data["sources"] = [parse_source(s, "--source") for s in sources]
    data.update({k: v for k, v in options.items() if v is not None})
    return Spec.from_dict(data, where)


@click.group(context_settings={"help_option_names": ["-h", "--help"], "show_default": True})
@click.version_option(package_name="omniload")
def main() -> None:
    """omniload: one data coordinator per training job."""


@main.command(cls=_GroupedCommand, context_settings={"ignore_unknown_options": False})
@spec_options
@click.option(
    "--host", default="127.0.0.1", help="Address the coordinator listens on.", cls=_GroupedOption, group="serving"
)
@click.option("--port", default=0, type=int, help="Port (0: any free port).", cls=_GroupedOption, group="serving")
@click.option(
    "--progress-every", default=_PROGRESS_S, type=float, help="Seconds between progress lines on stderr (0: none)."
)
@click.option("-q", "--quiet", is_flag=True, help="No progress lines.")
@click.option(
    "--standby",
    default=0,
    type=click.IntRange(min=0),
    cls=_GroupedOption,
    group="high availability",
    help="Standby coordinators beside the primary: one takes over if the primary dies (needs "
    "--checkpoint-dir); a lost one is replaced.",
)
@click.argument("cmd", nargs=-1, required=True, type=click.UNPROCESSED)
def launch(
    config: str | None,
    sources: tuple[str, ...],
    host: str,
    port: int,
    progress_every: float,
    quiet: bool,
    standby: int,
    cmd: tuple[str, ...],
    **options: Any,
) -> None:
    """Start the coordinator, run CMD (e.g. torchrun ...) beside it, stop it when CMD exits.

    CMD gets OMNILOAD_ADDR and OMNILOAD_TOKEN in its environment; the exit code is CMD's."""
    spec = _or_exit(lambda: build_spec(config, sources, options))
    sys.exit(
        run_launch(
            spec, list(cmd), host=host, port=port, progress_every=0 if quiet else progress_every, standby=standby
        )
    )


@main.command(cls=_GroupedCommand)
@spec_options
@click.option(
    "--host",
    default="0.0.0.0",
    help="Address to listen on (reachable by every node).",
    cls=_GroupedOption,
    group="serving",
)
@click.option("--port", default=0, type=int, help="Port (0: any free port).", cls=_GroupedOption, group="serving")
@click.option(
    "--as-standby",
    "as_standby",
    is_flag=True,
    cls=_GroupedOption,
    group="high availability",
    help="Run as a standby of the primary using the same --checkpoint-dir (shared) and OMNILOAD_TOKEN: "
    "it takes over when the primary dies or its lease expires.",
)
@click.option(
    "--primary",
    default=None,
    metavar="HOST:PORT",
    cls=_GroupedOption,
    group="high availability",
    help="With --as-standby: the primary's address, put first in the printed OMNILOAD_ADDR.",
)
def serve(
    config: str | None,
    sources: tuple[str, ...],
    host: str,
    port: int,
    as_standby: bool,
    primary: str | None,
    **options: Any,
) -> None:
    """Run the coordinator alone (multi-node jobs); prints OMNILOAD_ADDR and OMNILOAD_TOKEN for the ranks."""
    from omniload.coordinator.observe.logs import setup_logging
    from omniload.coordinator.server import Coordinator

    spec = _or_exit(lambda: build_spec(config, sources, options))
    if as_standby and not (os.environ.get("OMNILOAD_TOKEN") and spec.checkpoint_dir):
        raise click.UsageError(
            "--as-standby needs the primary's OMNILOAD_TOKEN in the environment and its "
            "--checkpoint-dir (a folder both hosts share)"
        )
    token = os.environ.get("OMNILOAD_TOKEN") or secrets.token_hex(16)
    setup_logging()

    def announce(addr: str, metrics: str | None) -> None:
        addr = f"{primary},{addr}" if as_standby and primary else addr
        click.echo(f"OMNILOAD_ADDR={addr}\nOMNILOAD_TOKEN={token}")
        if metrics:
            click.echo(f"# metrics: http://{metrics}/metrics")
        sys.stdout.flush()

    sys.exit(_or_exit(lambda: Coordinator(spec, token, host, port, announce=announce, standby=as_standby).run()))


@main.command(context_settings={"ignore_unknown_options": False})
@click.option("--addr", envvar="OMNILOAD_ADDR", required=True, help="The coordinator's HOST:PORT.")
@click.option("--token", envvar="OMNILOAD_TOKEN", required=True, help="The job's token.")
@click.option(
    "--socket",
    "path",
    default=None,
    help="Unix socket the node's ranks connect to [default: a new one in the temp folder].",
)
@click.argument("cmd", nargs=-1, type=click.UNPROCESSED)
def relay(addr: str, token: str, path: str | None, cmd: tuple[str, ...]) -> None:
    """Run one relay per node: the node's ranks share its one connection to the coordinator.

    With CMD (e.g. torchrun ...), CMD runs with OMNILOAD_ADDR=unix:SOCKET and the relay stops
    when it exits (the exit code is CMD's); without, the relay runs until the coordinator ends
    and the ranks need OMNILOAD_ADDR=unix:SOCKET themselves."""
    from omniload.coordinator.loop import run_loop
    from omniload.coordinator.observe.logs import setup_logging
    from omniload.coordinator.serve.relay_process import default_socket_path, run_relay

    setup_logging()
    socket_path = path or default_socket_path()
    sys.exit(_or_exit(lambda: run_loop(run_relay(addr, token, socket_path, list(cmd)))))


@main.command(cls=_GroupedCommand)
@spec_options
@click.option(
    "--out",
    default=".",
    type=click.Path(file_okay=False),
    help="Folder the manifests go to, one SOURCE.manifest.npz a source (beside the data, or in the cache).",
)
def index(config: str | None, sources: tuple[str, ...], out: str, **options: Any) -> None:
    """List and index the sources' objects once, and write each source's manifest (its objects,
    sizes, versions, rows): a job whose source says manifest=FILE lists and indexes nothing."""
    from pathlib import Path

    from omniload.coordinator.pool.catalog import write_manifests

    spec = _or_exit(lambda: build_spec(config, sources, options))
    for path, objects, rows, bad in _or_exit(lambda: write_manifests(spec, Path(out))):
        click.echo(f"{path}: {objects:,} files, {rows:,} rows")
        for file, _, why in bad:
            click.echo(f"  cannot be read, recorded as such: {file}: {why}")


@main.command()
@click.option("--addr", envvar="OMNILOAD_ADDR", required=True, help="The coordinator's HOST:PORT.")
@click.option("--token", envvar="OMNILOAD_TOKEN", required=True, help="The job's token.")
@click.option("--set", "weights", required=True, metavar="NAME=W[,NAME=W]", help="New weights; others keep theirs.")
def mix(addr: str, token: str, weights: str) -> None:
    """Change the mixture of a running job from the next step it plans."""
    from omniload.control import parse_weights, set_weights

    step = _or_exit(lambda: set_weights(addr, token, parse_weights(weights)))
    click.echo(f"omniload: new weights take effect at step {step}")


@main.command()
@click.option("--addr", envvar="OMNILOAD_ADDR", required=True, help="The coordinator's HOST:PORT.")
@click.option("--token", envvar="OMNILOAD_TOKEN", required=True, help="The job's token.")
@click.option("--json", "as_json", is_flag=True, help="Print the figures once as JSON (for scripts).")
@click.option("--once", is_flag=True, help="Print the table once instead of refreshing it.")
@click.option("--interval", default=1.0, type=float, help="Seconds between refreshes.")
def status(addr: str, token: str, as_json: bool, once: bool, interval: float) -> None:
    """Show a running job: sources, ranks and planner, refreshed in place until Ctrl-C or the job ends."""
    import json

    from omniload.control import job_status
    from omniload.status_view import render

    if as_json:
        click.echo(json.dumps(_or_exit(lambda: job_status(addr, token)), indent=1))
        return
    live = not once and sys.stdout.isatty()
    figures = _or_exit(lambda: job_status(addr, token))  # a wrong address or token: exit 1 naming it
    try:
        while True:
            click.echo(("\x1b[H\x1b[J" if live else "") + render(figures))
            if not live:
                return
            time.sleep(interval)
            figures = job_status(addr, token)
    except OmniloadError as exc:
        click.echo(f"omniload: the job ended or cannot be reached ({exc})", err=True)
    except KeyboardInterrupt:
        pass


@main.command()
@click.option("--steps", default=40, type=int, help="Training steps.")
@click.option("--nproc", default=2, type=int, help="Ranks (torchrun --nproc_per_node).")
@click.option(
    "--dir", "directory", default=None, help="Where the generated corpus goes [default: ~/.cache/omniload/demo]."
)
@click.option(
    "--attention",
    type=click.Choice(["document", "causal"]),
    default="document",
    show_default=True,
    help="document: each token attends within its packed document (cu_seqlens); causal: across the row.",
)
def demo(steps: int, nproc: int, directory: str | None, attention: str) -> None:
    """Generate a small corpus and train a tiny GPT on it with torchrun through omniload (CPU)."""
    from omniload.demo.corpus import demo_spec, make_corpus

    os.environ["OMNILOAD_DEMO_ATTENTION"] = attention  # the ranks inherit it through launch

    root = make_corpus(directory)
    spec = demo_spec(root, steps=steps)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        "-m",
        "omniload.demo.train",
    ]
    click.echo(f"omniload demo: corpus in {root}; {nproc} ranks, {steps} steps", err=True)
    sys.exit(run_launch(spec, cmd))


def run_launch(
    spec: Spec,
    cmd: list[str],
    host: str = "127.0.0.1",
    port: int = 0,
    progress_every: float = _PROGRESS_S,
    standby: int = 0,
) -> int:
    """Run CMD beside a coordinator for `spec` (and `standby` standbys); returns CMD's exit code (or the
    coordinator's, if it failed). Every `progress_every` seconds (0: never) one progress line goes to stderr."""
    from omniload.job import Job

    job = _or_exit(lambda: Job(spec, host=host, port=port, standby=standby))
    _or_exit(job.start, quiet=True)  # the coordinator has printed the reason
    child = None
    next_progress = time.monotonic() + progress_every
    try:
        child = subprocess.Popen(cmd, env={**os.environ, **job.env()})
        while (code := child.poll()) is None:
            coordinator = job.poll()
            if coordinator not in (None, 0):
                click.echo(f"omniload: the coordinator exited with code {coordinator}; stopping {cmd[0]}", err=True)
                _stop_child(child)
                return coordinator
            if progress_every and time.monotonic() >= next_progress:
                next_progress = time.monotonic() + progress_every
                _say_progress(job)
            time.sleep(0.2)
        if code != 0 and _wait_quietly(job, _CHILD_STOP_S) == ConfigError.exit_code:
            return ConfigError.exit_code  # CMD failed because the job's config is bad: say so
        return code if code >= 0 else 128 - code
    except KeyboardInterrupt:
        if child is not None:  # it got the same Ctrl-C; give it time to exit on its own
            _stop_child(child)
        return 130
    except FileNotFoundError:
        click.echo(f"omniload: error: command not found: {cmd[0]}", err=True)
        return 127
    finally:
        job.stop()


def _say_progress(job: Any) -> None:
    from omniload.control import job_status
    from omniload.status_view import progress_line

    try:
        click.echo(progress_line(job_status(job.addr, job.token, timeout=5.0)), err=True)
    except OmniloadError:
        pass  # the job is ending; the coordinator's own messages say why


def _wait_quietly(job: Any, timeout: float) -> int | None:
    try:
        return job.wait(timeout)
    except subprocess.TimeoutExpired:
        return None


def _stop_child(child: subprocess.Popen) -> None:
    """Give CMD time to exit on its own (its ranks got the error, or the same Ctrl-C), then stop it."""
    from omniload.job import stop_process

    try:
        child.wait(_CHILD_STOP_S)
    except subprocess.TimeoutExpired:
        stop_process(child, _CHILD_STOP_S)


def _or_exit(action: Callable[[], Any], quiet: bool = False) -> Any:
    """Run `action`; turn omniload's errors into a one-line message and exit code (2 for bad input)."""
    try:
        return action()
    except OmniloadError as exc:
        if not quiet:
            click.echo(f"omniload: error: {exc}", err=True)
        sys.exit(exc.exit_code if isinstance(exc, ConfigError) else 1)


@main.command()
@click.option("--checkpoint-dir", required=True, envvar="OMNILOAD_CHECKPOINT_DIR", help="The job's --checkpoint-dir.")
@click.option("--step", required=True, type=click.IntRange(min=0), help="The step to trace, 0-based (loader.step).")
@click.option("--rank", type=click.IntRange(min=0), help="Only this global rank's batch (its data-parallel replica's).")
@click.option("--dp-rank", type=click.IntRange(min=0), help="Only this data-parallel rank's batch.")
@click.option("--workers", default=2, type=click.IntRange(min=1), help="Source workers for the replay.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts instead of a table.")
def trace(checkpoint_dir: str, step: int, rank: int | None, dp_rank: int | None, workers: int, as_json: bool) -> None:
    """Which documents trained STEP on each data-parallel rank, recomputed from the checkpoint folder."""
    import orjson

    from omniload.coordinator.observe.logs import setup_logging
    from omniload.coordinator.observe.trace import format_trace, trace_step, trace_to_dict

    if rank is not None and dp_rank is not None:
        raise click.UsageError("give --rank or --dp-rank, not both")
    setup_logging()
    found = _or_exit(lambda: trace_step(checkpoint_dir, step, rank=rank, dp_rank=dp_rank, workers=workers))
    click.echo(orjson.dumps(trace_to_dict(found)).decode() if as_json else format_trace(found))


if __name__ == "__main__":
    main()
