"""Trace room: the Megatron launch configuration, from `megatron_args.txt` or a rank log's arguments block.

Both sources become one dict keyed by Megatron's argument names with
underscores (`--num-layers 12` and `  num_layers ....... 12` both give
`{"num_layers": 12}`), so the spec reads one shape whatever the job wrote.
"""

from __future__ import annotations

import ast
import re
import shlex
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hops_calib.trace.errors import TraceError
from hops_calib.trace.reading import read_config_text, text_lines

ARGS_FILE = "megatron_args.txt"
# Megatron prints its arguments between these two rulers (any number of dashes). The patterns run in time linear
# in the line (a run starts only where the one before it cannot, and nothing matched is given back): a rank log
# line can be long.
_BLOCK_START = re.compile(r"(?<!-)-{3,}+\s*+arguments\s*+---")
_BLOCK_END = re.compile(r"(?<!-)-{3,}+\s*+end of arguments\s*+---")
# "  num_layers ...................................... 12", possibly behind a launcher prefix like "[rank0]: ".
_BLOCK_LINE = re.compile(r"(?<!\w)(\w++) \.{2,}+ ?+(.*)")
# Files of a job directory that may hold a Megatron rank log (stdout/stderr of the ranks).
_LOG_SUFFIXES = (".log", ".out", ".err", ".txt")


def parse_value(text: str) -> Any:
    """A Megatron argument value from its printed form: int, float, bool, None, list, else the string."""
    if text in ("True", "False"):
        return text == "True"
    if text == "None":
        return None
    for convert in (int, float):
        try:
            return convert(text)
        except ValueError:
            pass
    if text[:1] in "[(":
        try:
            return ast.literal_eval(text)
        except (ValueError, SyntaxError, RecursionError, MemoryError):
            pass
    return text


@dataclass(frozen=True)
class Launch:
    """A job's launch, read once: Megatron's arguments, the file they came from, and the GPUs per node of a
    multi-node torchrun launch (global rank r on node r // gpus_per_node; None for a one-node launch, a command
    line without a launcher, or a rank log's arguments block, which prints no placement)."""

    args: dict[str, Any]
    source: Path
    gpus_per_node: int | None = None
    # the GPUs of a one-node torchrun launch (--nnodes 1, torchrun's default, with --nproc-per-node N): every rank
    # on that one node; None otherwise
    one_node_gpus: int | None = None
    # NAME=VALUE assignments before the launcher on the command line (`NCCL_NET=Socket torchrun ...`): the launch's
    # environment, as far as the file says it
    environment: tuple[tuple[str, str], ...] = ()

    def transport(self) -> str:
        """The transport NCCL runs inter-node traffic over, as the launch's environment says it (`transport_name`):
        NCCL_NET names it; NCCL_IB_DISABLE=1 without a network plugin (NCCL_NET_PLUGIN) leaves NCCL its socket
        transport; "" when the environment says neither. NCCL_SOCKET_IFNAME says nothing: it names the interface
        of NCCL's bootstrap connections, which InfiniBand runs use too."""
        from hops_calib.trace.link_bench import transport_name

        env = dict(self.environment)
        if env.get("NCCL_NET"):
            return transport_name(env["NCCL_NET"])
        if env.get("NCCL_IB_DISABLE", "").strip().lower() in ("1", "true", "yes") and not env.get("NCCL_NET_PLUGIN"):
            return "socket"
        return ""


def parse_command_line(text: str, path: Path | str = ARGS_FILE) -> dict[str, Any]:
    """Arguments of a `pretrain_gpt.py --flag value ...` command line.

    A flag with no value is True; a flag with several values gets a list.
    """
    return _parse_launch(text, path)[0]


_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")  # a shell variable's name, as `NAME=value cmd` assigns it


def _parse_launch(
    text: str, path: Path | str
) -> tuple[dict[str, Any], int | None, tuple[tuple[str, str], ...], int | None]:
    """A command line's arguments (`parse_command_line`), its launcher's GPUs per node (`Launch.gpus_per_node`:
    --nproc-per-node when --nnodes is a plain integer above 1, else None), the environment assignments before
    its launcher, and a one-node launch's GPUs (`Launch.one_node_gpus`), from one split of it."""
    launcher, tokens = _split(text, path)
    environment = tuple(
        (name, value)
        for name, sep, value in (token.partition("=") for token in launcher or ())
        if sep and _ENV_NAME.fullmatch(name)
    )
    # the world size the launcher gives is the launch's (Megatron computes the data parallel size from it)
    launcher_world, per_node = _launcher_layout(launcher) if launcher is not None else (None, None)
    one_node = launcher_world if launcher_world is not None and per_node is None else None
    args: dict[str, Any] = {}
    key: str | None = None
    values: list[Any] = []

    def flush() -> None:
        if key is not None:
            args[key] = True if not values else values[0] if len(values) == 1 else values

    for token in tokens:
        if token.startswith("--"):
            flush()
            name, _, inline = token[2:].partition("=")
            key, values = name.replace("-", "_"), ([parse_value(inline)] if inline else [])
        elif key is not None:
            values.append(parse_value(token))
        # A value before the first flag has no argument to belong to.
    flush()
    if launcher_world is not None and "world_size" not in args:
        args["world_size"] = launcher_world
    return args, per_node, environment, one_node


def _split(text: str, path: Path | str) -> tuple[list[str] | None, list[str]]:
    """A command line's tokens before the training script (the launcher's: torchrun --nproc-per-node ...; None
    without a script) and after it (the script's arguments)."""
    try:
        tokens = shlex.split(text, comments=False)
    except ValueError as err:
        raise TraceError(
            path,
            f"cannot split the command line ({err})",
            line=1,
            hint="write the launch command on one line with balanced quotes",
        ) from err
    scripts = [k for k, token in enumerate(tokens) if token.endswith(".py")]
    if not scripts:
        return None, tokens
    return tokens[: scripts[-1]], tokens[scripts[-1] + 1 :]


def _launcher_options(tokens: list[str]) -> dict[str, str]:
    """torchrun's --nnodes and --nproc-per-node (either spelling, either form) among the launcher's tokens."""
    found: dict[str, str] = {}
    for k, token in enumerate(tokens):
        if not token.startswith("--"):
            continue
        name, _, inline = token[2:].partition("=")
        name = name.replace("_", "-")
        if name in ("nnodes", "nproc-per-node"):
            found[name] = inline or (tokens[k + 1] if k + 1 < len(tokens) else "")
    return found


def _launcher_layout(tokens: list[str]) -> tuple[int | None, int | None]:
    """The world size of a torchrun (torch.distributed.run) launch, nnodes (default 1) x nproc-per-node, and its
    GPUs per node when nnodes > 1; each None unless the counts it needs are plain integers (absent, an elastic
    range "1:4", or "gpu"/"auto" are not)."""
    found = _launcher_options(tokens)
    try:
        nodes, per_node = int(found.get("nnodes", "1")), int(found["nproc-per-node"])  # torchrun's default: one node
    except (KeyError, ValueError):
        return None, None
    return nodes * per_node, (per_node if nodes > 1 and per_node >= 1 else None)


def read_args_file(path: Path) -> dict[str, Any]:
    return read_launch_file(path).args


def read_launch_file(path: Path) -> Launch:
    """The launch of a `megatron_args.txt`: its arguments and torchrun's placement, from one read of the file."""
    args, per_node, environment, one_node = _parse_launch(read_config_text(path), path)
    if not args:
        raise TraceError(
            path,
            "no --arguments found",
            line=1,
            hint="the file must hold Megatron's launch command, e.g. 'pretrain_gpt.py --num-layers 12 ...'",
        )
    return Launch(args, path, per_node, one_node, environment)


def parse_arguments_block(lines: Iterable[str]) -> dict[str, Any] | None:
    """The arguments Megatron printed into a rank log, or None when the log has no such block.

    Reads lines only up to the end of the block, so a huge log costs little
    when the block is near its start (where Megatron prints it).
    """
    args: dict[str, Any] | None = None
    for line in lines:
        if args is None:
            if _BLOCK_START.search(line):
                args = {}
            continue
        if _BLOCK_END.search(line):
            return args
        match = _BLOCK_LINE.search(line)
        if match:
            args[match.group(1)] = parse_value(match.group(2).rstrip())
    return args


def find_arguments(job_dir: Path) -> tuple[dict[str, Any], Path]:
    """The configuration of a job and the file it came from (`find_launch`)."""
    launch = find_launch(job_dir)
    return launch.args, launch.source


def find_launch(job_dir: Path) -> Launch:
    """The launch of a job: `megatron_args.txt`, else the first rank log with an arguments block.

    Never opens the event logs (`megatron_trace/`): they hold measurements, not configuration.
    """
    args_file = job_dir / ARGS_FILE
    if args_file.exists() or args_file.is_symlink():  # (read_config_text refuses what is not a regular file)
        return read_launch_file(args_file)
    candidates: list[Path] = []
    for folder in (job_dir, job_dir / "logs"):
        if folder.is_dir():
            candidates += sorted(p for p in folder.iterdir() if p.is_file() and p.suffix in _LOG_SUFFIXES)
    for candidate in candidates:
        args = parse_arguments_block(text for _, text in text_lines(candidate))
        if args:
            return Launch(args, candidate)
    raise TraceError(
        job_dir / ARGS_FILE,
        "missing: no Megatron configuration in this job directory",
        field="megatron arguments",
        hint=f"add {ARGS_FILE} with the launch command, or a rank log (*.log/*.out in the job "
        "directory or logs/) holding Megatron's '---- arguments ----' block",
    )
