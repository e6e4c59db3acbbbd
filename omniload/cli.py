"""`omniload launch | serve | relay | demo | ...`.

Every job option is one `Spec` field, whose row in omniload.spec_options gives its group, help
and value; its flag, OMNILOAD_<NAME> variable and --help come from there, as docs/cli.md's tables do
(omniload.cli_docs). The same name works in `--config` files; a flag overrides the file.
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

from omniload.cli_docs import CONFIG_HELP, SOURCE_HELP, SOURCE_VALUE, default_of, env_name, flag_name, plain
from omniload.errors import ConfigError, OmniloadError
from omniload.spec import Spec, coerce_option, load_config, parse_source
from omniload.spec_options import GROUP_NAMES, OPTIONS, Option

_CHILD_STOP_S = 10.0
_PROGRESS_S = 30.0


class _GroupedOption(click.Option):
    """An option that names its section of --help (one of GROUP_NAMES)."""

    def __init__(self, *args: Any, group: str, **kwargs: Any) -> None:
        if group not in GROUP_NAMES:
            raise ValueError(f"unknown option group {group!r}; groups: {', '.join(GROUP_NAMES)}")
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
        for group in [*GROUP_NAMES, ""]:
            if sections.get(group):
                with formatter.section(group.capitalize() or "Options"):
                    formatter.write_dl(sections[group])


_FIELD_TYPES = {f.name: f.type for f in dataclasses.fields(Spec)}


def _spec_option(name: str, spec_option: Option) -> dict[str, Any]:
    """click's keywords for a Spec field's flag. Values stay text here and are converted as a
    --config file's are (build_spec)."""
    kwargs: dict[str, Any] = {
        "default": None,
        "envvar": env_name(name),
        "help": f"{plain(spec_option.help)}  [default: {plain(default_of(name))}]",
    }
    if spec_option.choices:
        kwargs["type"] = click.Choice(spec_option.choices)
    elif _FIELD_TYPES[name] == "bool":
        kwargs["is_flag"] = True
    else:
        kwargs["metavar"] = spec_option.metavar
    return kwargs


def spec_options(command: Callable) -> Callable:
    for name, spec_option in reversed(OPTIONS.items()):
        if spec_option.has_flag:
            command = click.option(
                flag_name(name), name, cls=_GroupedOption, group=spec_option.group, **_spec_option(name, spec_option)
            )(command)
    command = click.option(
        "--source",
        "sources",
        multiple=True,
        metavar=SOURCE_VALUE,
        cls=_GroupedOption,
        group="data",
        help=plain(SOURCE_HELP),
    )(command)
    return click.option(
        "--config",
        "config",
        type=click.Path(dir_okay=False),
        cls=_GroupedOption,
        group="data",
        help=plain(CONFIG_HELP),
    )(command)


def build_spec(config: str | None, sources: tuple[str, ...], options: dict[str, Any]) -> Spec:
    data = load_config(config) if config else {}
    where = f"config file {config!r}" if config else "flags"
    if sources:
        data["sources"] = [parse_source(s, "--source") for s in sources]
    # converted here, so that a bad value names its flag, not the file it overrides
    data.update(
        {
            name: coerce_option(name, value, f"{flag_name(name)} (or {env_name(name)})")
            for name, value in options.items()
            if value is not None
        }
    )
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
