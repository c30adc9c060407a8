"""Megatron training-log text, written with the format strings of the code that prints it (cited per function).

Used by the iteration-level tests to write logs exactly as Megatron-LM, Megatron-DeepSpeed and megatron-core
print them.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any, Iterable


def arguments_block(args: dict[str, Any], title: str = "arguments") -> list[str]:
    """Megatron-LM megatron/training/arguments.py::_print_args (the same in Megatron-DeepSpeed)."""
    lines = [f"------------------------ {title} ------------------------"]
    str_list = []
    for arg, value in args.items():
        dots = "." * (48 - len(arg))
        str_list.append("  {} {} {}".format(arg, dots, value))
    for arg in sorted(str_list, key=lambda x: x.lower()):
        lines.append(arg)
    lines.append(f"-------------------- end of {title} ---------------------")
    return lines


def padded_vocab_line(orig: int, padded: int) -> str:
    """Megatron-LM megatron/training/tokenizer/tokenizer.py::_vocab_size_with_padding."""
    return " > padded vocab (size: {}) with {} dummy tokens (new size: {})".format(orig, padded - orig, padded)


def megatron_lm_iteration(iteration: int, train_iters: int, consumed: int, elapsed_s: float, *,
                          throughput: float | None = None, batch_size: int = 16, when: datetime | None = None,
                          learning_rate: float = 2.4e-5, loss: float = 6.512331, grad_norm: float = 1.208) -> str:
    """Megatron-LM megatron/training/training.py::training_log (the `log_string` it prints every --log-interval
    iterations; `throughput` only under --log-throughput; the timestamp prefix since 2024)."""
    log_string = f" [{when.strftime('%Y-%m-%d %H:%M:%S')}]" if when is not None else ""
    log_string += " iteration {:8d}/{:8d} |".format(iteration, train_iters)
    log_string += " consumed samples: {:12d} |".format(consumed)
    log_string += " elapsed time per iteration (ms): {:.1f} |".format(elapsed_s * 1000.0)
    if throughput is not None:
        log_string += f" throughput per GPU (TFLOP/s/GPU): {throughput:.1f} |"
    log_string += f" learning rate: {learning_rate:.6E} |"
    log_string += f" global batch size: {batch_size:5d} |"
    log_string += " {}: {:.6E} |".format("lm loss", loss)
    log_string += f" loss scale: {1.0:.1f} |"
    log_string += f" grad norm: {grad_norm:.3f} |"
    log_string += " number of skipped iterations: {:3d} |".format(0)
    log_string += " number of nan iterations: {:3d} |".format(0)
    return log_string


def megatron_deepspeed_iteration(iteration: int, train_iters: int, consumed: int, elapsed_s: float, *,
                                 batch_size: int, seq_length: int, samples_per_sec: float, tflops: float) -> str:
    """Megatron-DeepSpeed megatron/training.py::training_log (no timestamp, no TFLOP/s field of Megatron-LM; it
    adds consumed tokens, actual seqlen, samples per second and TFLOPs)."""
    log_string = " iteration {:8d}/{:8d} |".format(iteration, train_iters)
    log_string += " consumed samples: {:12d} |".format(consumed)
    log_string += " consumed tokens: {:12d} |".format(consumed * seq_length)
    log_string += " elapsed time per iteration (ms): {:.1f} |".format(elapsed_s * 1000.0)
    log_string += " learning rate: {:.3E} |".format(2.4e-5)
    log_string += " global batch size: {:5d} |".format(batch_size)
    log_string += " {}: {:.6E} |".format("lm loss", 6.5)
    log_string += " loss scale: {:.1f} |".format(4096.0)
    log_string += " grad norm: {:.3f} |".format(1.2)
    log_string += " actual seqlen: {:5d} |".format(seq_length)
    log_string += " number of skipped iterations: {:3d} |".format(0)
    log_string += " number of nan iterations: {:3d} |".format(0)
    log_string += " samples per second: {:.3f} |".format(samples_per_sec)
    log_string += " TFLOPs: {:.2f} |".format(tflops)
    return log_string


def timers_block(option: str, times: dict[str, list[float]]) -> list[str]:
    """megatron-core megatron/core/timers.py::Timers.get_all_timers_string (via _get_global_min_max_time_string for
    `max` / `minmax`, _get_all_ranks_time_string for `all`); `times[name]` holds each rank's value in ms, already
    divided by the normalizer (--log-interval) as Timers.log does. A rank at 0 did not run the timer."""
    if option in ("max", "minmax"):
        output_string = "max time across ranks (ms):" if option == "max" else "(min, max) time across ranks (ms):"
        for name, per_rank in times.items():
            ran = [t for t in per_rank if t > 0.0]
            if not ran:
                continue
            if option == "max":
                output_string += "\n    {}: {:.2f}".format((name + " ").ljust(48, "."), max(ran))
            else:
                output_string += "\n    {}: ({:.2f}, {:.2f})".format((name + " ").ljust(48, "."), min(ran), max(ran))
        return output_string.split("\n")
    output_string = "times across ranks (ms):"
    for name, per_rank in times.items():
        not_yet_found = True
        for rank, value in enumerate(per_rank):
            if value > 0:
                if not_yet_found:
                    not_yet_found = False
                    output_string += "\n  {}:".format(name)
                output_string += "\n     rank {:2d}: {:.2f}".format(rank, value)
    return output_string.split("\n")


def legacy_timers_line(times: dict[str, float]) -> str:
    """Megatron-LM megatron/timers.py::Timers.log before the 2022 rewrite (Megatron-DeepSpeed keeps it): one line,
    the printing rank's elapsed time of each timer x 1000 / normalizer."""
    string = "time (ms)"
    for name, elapsed_time in times.items():
        string += " | {}: {:.2f}".format(name, elapsed_time)
    return string


def write_log(path, lines: Iterable[str]) -> None:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def timestamps(start: datetime, step_s: float) -> Iterable[datetime]:
    k = 0
    while True:
        yield start + timedelta(seconds=k * step_s)
        k += 1
