"""Imported by the workers' forkserver before it forks any worker (FORKSERVER_PRELOAD in
coordinator/pool/forkserver.py), never by the coordinator: it loads there, once, the
tokenizer.json files the coordinator named (forkserver.share_tokenizers), paths or Hub model ids
(read from the Hub's cache). Each worker forked
after finds its tokenizer already in transforms.load_transform's cache, and the workers share
its pages with the forkserver instead of each parsing the file and holding a copy of its own
(a 32k BPE: 0.06 s and about 7.5 MB a worker).

Only tokenizer.json files: a `module:function` tokenizer is the user's code, whose import may
start threads, and a process must not fork after that. A file that does not load is skipped:
the indexing child (catalog.check_tokenizers) reports it, naming the source.
"""

from __future__ import annotations

import json
import os

from omniload.errors import ConfigError
from omniload.formats.lane_config import PRELOADED_TOKENIZERS_ENV
from omniload.workers.transforms import load_transform, names_tokenizer_file
from omniload.workers.worker import release_freed_memory


def load_named_tokenizers() -> None:
    """Load every tokenizer.json the environment names; skip whatever fails to load."""
    try:
        named = json.loads(os.environ.get(PRELOADED_TOKENIZERS_ENV) or "[]")
        names = [n for n in named if names_tokenizer_file(n)]
    except (ValueError, TypeError, AttributeError):  # not share_tokenizers' list: the forkserver must live on
        names = []
    for name in names:
        try:
            load_transform(name)  # a panic while loading is a ConfigError too (transforms._tokenizer_file)
        except ConfigError:
            pass
    if names:
        release_freed_memory()  # parsing the JSON left some 12 MB of free heap that no worker needs


load_named_tokenizers()
