"""Trace room: NVIDIA's dgxc-benchmarking DGX H100 runs (`../shared/public-runs/dgxc-h100/runs.csv`, v25.04.02)
read as they are published.

`runs.csv` holds one measured run per row (model, precision, GPUs, the parallel sizes, batch, step time);
`models.csv` beside it the architecture per model and `settings.csv` the run settings per model, each with the
repository file it was read from, or `not stated`. The mapping onto Megatron's arguments (docs/sources-dgxc.md
gives it column by column):

- a row's columns (`COLUMNS`) map one to one; `vp` NA is no virtual stages, except where settings.csv records the
  launch file's own value (Nemotron-4 340B: the README table prints NA, `nemotron/launch.sh` passes `-vp 12`);
- the architecture comes from models.csv (`ARCHITECTURE`), the per-run `num_layers` of the 405B proxies from the row;
- the settings a launch flag prices come from settings.csv (`SETTINGS`): a value the file states is used, one it
  marks `not stated` takes the assumption in `ASSUMED` (each with its reason), and a value this mapping cannot
  read is an error naming settings.csv's line;
- FP8 rows run Transformer Engine's FP8 (`--fp8-format hybrid`), and keep and reduce their gradients in bf16
  (`--grad-reduce-in-bf16`) where settings.csv's fp8_recipe states grad_reduce_in_fp32 = False (the Llama 3.1
  rows); a row with a setting the spec refuses is stored and listed as not priced;
- the Llama 3.1 405B rows and its 30/62-layer proxies, whose uneven split settings.csv leaves `not stated`, count
  the embedding and the loss as a layer each (`ASSUMED_SPLIT`: the arithmetic that makes their layers split);
- the machine is the catalog's `h100_dgx` (settings.csv `all`: 8 x H100 80 GB HBM3 per node, NVLink 4, 8 x 400
  Gb/s InfiniBand); the measurement is `step_time_s` (the last of 50 steps), and the printed tokens/s is kept as
  the row's own samples/s (tokens/s over the sequence length).

Each model and precision is one weak-scaling sweep (one recipe at every GPU count): the sweep is the group that
shares a split.
"""

from __future__ import annotations

import csv
import io
from dataclasses import replace
from pathlib import Path
from typing import Any

from hops_calib.trace.errors import TraceError
from hops_calib.trace.measured import RunHardware
from hops_calib.trace.run_table import TableRead, read_run_table
from hops_calib.trace.vtrain import padded_vocab

RUNS_HEADER = (
    "source_file",
    "model",
    "precision",
    "gpus",
    "seq_length",
    "num_layers",
    "tp",
    "pp",
    "cp",
    "ep",
    "dp",
    "vp",
    "mbs",
    "gbs",
    "ga",
    "step_time_s",
    "tokens_per_s_reported",
    "mfu_reported_pct",
)
MODELS_FILE, SETTINGS_FILE = "models.csv", "settings.csv"
COMPANIONS = (MODELS_FILE, SETTINGS_FILE)
TABLE_ID = "dgxc_h100"
GPU = "h100_dgx"  # the catalog's DGX/HGX H100 node (settings.csv, model=all)
MAPPING = "dgxc-benchmarking v25.04.02 runs.csv + models.csv + settings.csv (hops_calib/trace/dgxc.py)"
PRECISIONS = ("bf16", "fp8")

# runs.csv column -> Megatron's argument (args. spelling); `ep` is NA on every row (dense models), `ga` follows
# from the batch sizes and is checked by the run-table reader (gbs = dp x mbs x microbatches).
COLUMNS = {
    "gpus": "world_size",
    "seq_length": "seq_length",
    "num_layers": "num_layers",
    "tp": "tensor_model_parallel_size",
    "pp": "pipeline_model_parallel_size",
    "cp": "context_parallel_size",
    "dp": "data_parallel_size",
    "vp": "virtual_pipeline_model_parallel_size",
    "mbs": "micro_batch_size",
    "gbs": "global_batch_size",
}
# models.csv column -> how it maps (the categorical ones: `_architecture`).
ARCHITECTURE = (
    "num_layers",
    "hidden_size",
    "ffn_hidden_size",
    "num_attention_heads",
    "num_query_groups",
    "vocab_size",
    "normalization",
    "activation",
    "position_embedding",
    "tied_embeddings",
)
_ACTIVATIONS = {
    "gelu": {},
    "swiglu": {"swiglu": True},
    # squared ReLU (Nemotron-4, Megatron's --squared-relu): the same two GEMMs as the GeLU MLP, another
    # elementwise function of the same bytes; priced as the GeLU MLP
    "squared-relu": {"squared_relu": True},
}
_POSITIONS = {"learned absolute": "learned_absolute", "rope": "rope"}
_NORMS = {"layernorm": "LayerNorm", "rmsnorm": "RMSNorm"}

# settings.csv setting -> Megatron's argument it gives. Read per model (`_switch`): True/False where the file states
# it, ASSUMED where it says `not stated`.
SETTINGS = {
    "sequence_parallel": "sequence_parallel",
    "activation_recompute": "recompute_granularity",
    "distributed_optimizer": "use_distributed_optimizer",
    "overlap_grad_reduce": "overlap_grad_reduce",
    "overlap_param_gather": "overlap_param_gather",
    "tp_comm_overlap": "tp_comm_overlap",
    "overlap_p2p_comm": "overlap_p2p_comm",
}
# What settings.csv marks `not stated` (decided inside NeMo 2.0's recipes, which the set does not copy), assumed:
ASSUMED: dict[str, Any] = {
    # NeMo 2.0's performance recipes recompute nothing unless a recipe says so
    "recompute_granularity": None,
    # NeMo 2.0's recipes build the optimizer with use_distributed_optimizer=True and the DDP config with grad
    # and param overlap on (as the GPT-3 yaml states for its NeMo 1.0 run)
    "use_distributed_optimizer": True,
    "overlap_grad_reduce": True,
    "overlap_param_gather": True,
    # Megatron's default with virtual stages (and NeMo's MegatronCommOverlapCallback's), as the GPT-3 yaml states
    "overlap_p2p_comm": True,
    # NeMo's bf16_with_fp8_mixed and --compute_dtype fp8 run Transformer Engine's hybrid format (E4M3 forward,
    # E5M2 backward), as the GPT-3 yaml states for its run
    "fp8_format": "hybrid",
    # NeMo 2.0's Llama and Nemotron model configs train without dropout (the GPT-3 yaml states 0.1)
    "attention_dropout": 0.0,
    "hidden_dropout": 0.0,
}
# The 405B runs' uneven split (settings.csv uneven_pipeline_stages: not stated, "set inside the NeMo recipe"), assumed
# to be Megatron-core's embedding and loss counted as a layer each (--account-for-embedding-in-pipeline-split,
# --account-for-loss-in-pipeline-split; megatron/core/transformer/transformer_block.py get_num_layers_to_build): the
# only pipeline-split setting besides a full --pipeline-model-parallel-layout under which these layer counts build at
# all. 126 + 2 = 128 = 8 pp x 8 vp x 2 layers; the proxies' 62 + 2 = 64 = 4 x 8 x 2 and 30 + 2 = 32 = 4 x 8 x 1 (the
# first and last chunk then hold the embedding or the loss alone, as Megatron allows: num_layers_to_build >= 0).
# With either flag alone the counts (127, 63, 31) are odd and split over no pp; --decoder-first/last-pipeline-num-
# layers with virtual stages must be multiples of vp (transformer_config.py), and 126, 62, 30 are not multiples of 8.
ASSUMED_SPLIT = ("account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split")
# Every run: NeMo's Megatron-core GPT with Transformer Engine's layer (the GPT-3 yaml: mcore_gpt, transformer_engine;
# NeMo 2.0 always) and its fused attention (settings.csv attention_backend: NVTE_FUSED_ATTN=1 where stated), bf16
# parameters and arithmetic (trainer.precision bf16; FP8 GEMMs on top for the fp8 rows).
STATED: dict[str, Any] = {
    "transformer_impl": "transformer_engine",
    "bf16": True,
    "fp16": False,
    "make_vocab_size_divisible_by": 128,
}
_TRUE = ("true", "yes", "userbuffers on", "userbuffers:", "a tp-overlap")
_FALSE = ("false", "no ", "none", "off")


def is_dgxc_table(path: Path) -> bool:
    """Whether a CSV's header is dgxc-benchmarking's runs.csv."""
    from hops_calib.trace.reading import MAX_LINE_BYTES, open_regular

    if path.suffix.lower() != ".csv" or not path.is_file():
        return False
    with open_regular(path) as handle:
        header = handle.readline(MAX_LINE_BYTES).decode("utf-8-sig", errors="replace")
    return tuple(name.strip() for name in header.split(",")) == RUNS_HEADER


def dgxc_table_in(folder: Path) -> Path | None:
    """The runs.csv of a dgxc-h100 folder (the set as published), else None."""
    table = folder / "runs.csv"
    return table if folder.is_dir() and is_dgxc_table(table) else None


def _read_csv(path: Path, columns: tuple[str, ...]) -> list[tuple[int, dict[str, str]]]:
    """(line, row) of a companion CSV, its header checked; TraceError naming the file when absent or unreadable."""
    from hops_calib.trace.reading import MAX_LAYOUT_BYTES, read_config_text

    if not path.is_file():
        raise TraceError(
            path,
            "is missing: the dgxc runs.csv is read with the models.csv and settings.csv published beside it",
            hint="keep the three files of the set together",
        )
    text = read_config_text(path, MAX_LAYOUT_BYTES)
    reader = csv.DictReader(io.StringIO(text))
    missing = [c for c in columns if c not in (reader.fieldnames or [])]
    if missing:
        raise TraceError(
            path,
            f"has no {missing[0]} column",
            line=1,
            field=missing[0],
            hint=f"the published file has the columns {', '.join(columns)}",
        )
    return [(k + 2, {key: (value or "").strip() for key, value in row.items() if key}) for k, row in enumerate(reader)]


def read_models(path: Path) -> dict[str, tuple[int, dict[str, str]]]:
    return {row["model"]: (line, row) for line, row in _read_csv(path, ("model", *ARCHITECTURE))}


def read_settings(path: Path) -> dict[tuple[str, str], tuple[int, str]]:
    """(model, setting) -> (line, value); the first row of a pair (the container is listed twice, by two files)."""
    found: dict[tuple[str, str], tuple[int, str]] = {}
    for line, row in _read_csv(path, ("model", "setting", "value", "source")):
        found.setdefault((row["model"], row["setting"]), (line, row["value"]))
    return found


def _switch(path: Path, line: int, setting: str, value: str) -> bool | None:
    """A setting's value as on/off; None where the file says `not stated`; TraceError for a value this mapping
    does not read."""
    text = value.lower()
    if text.startswith("not stated"):
        return None
    if text.startswith(_TRUE):
        return True
    if text.startswith(_FALSE):
        return False
    raise TraceError(
        path,
        f"says {value!r}, which the dgxc mapping does not read as on or off",
        line=line,
        field=setting,
        hint="extend hops_calib/trace/dgxc.py (and docs/sources-dgxc.md) for it",
    )


def _architecture(path: Path, line: int, row: dict[str, str]) -> dict[str, Any]:
    """Megatron's arguments of a models.csv row (the layers are the run's where the row leaves them empty)."""

    def number(name: str) -> int:
        try:
            return int(row[name])
        except ValueError:
            raise TraceError(
                path,
                f"is {row[name]!r}, expected a whole number",
                line=line,
                field=name,
                hint="the published file gives it",
            ) from None

    args: dict[str, Any] = {
        name: number(name) for name in ("hidden_size", "ffn_hidden_size", "num_attention_heads", "vocab_size")
    }
    if row["num_layers"]:
        args["num_layers"] = number("num_layers")
    groups = number("num_query_groups")
    if groups != args["num_attention_heads"]:
        args.update(group_query_attention=True, num_query_groups=groups)
    for name, table in (("activation", _ACTIVATIONS), ("position_embedding", _POSITIONS), ("normalization", _NORMS)):
        key = row[name].lower()
        if key not in table:
            raise TraceError(
                path,
                f"is {row[name]!r}, which the dgxc mapping does not read",
                line=line,
                field=name,
                hint=f"known: {', '.join(table)}",
            )
        value = table[key]
        args.update(
            value
            if isinstance(value, dict)
            else {"position_embedding": {"position_embedding_type": value}, "normalization": {"normalization": value}}[
                name
            ]
        )
    if row["tied_embeddings"] not in ("tied", "untied"):
        raise TraceError(
            path, f"is {row['tied_embeddings']!r}", line=line, field="tied_embeddings", hint="tied or untied"
        )
    args["untie_embeddings_and_output_weights"] = row["tied_embeddings"] == "untied"
    return args


class Mapping:
    """The published set's translation of one runs.csv row into run-table columns (module docstring)."""

    def __init__(self, table: Path) -> None:
        folder = table.parent
        self.models_path, self.settings_path = folder / MODELS_FILE, folder / SETTINGS_FILE
        self.models = read_models(self.models_path)
        self.settings = read_settings(self.settings_path)
        line, per_node = self.settings.get(("all", "gpus_per_node"), (None, ""))
        if per_node != "8":
            raise TraceError(
                self.settings_path,
                f"says {per_node!r} GPUs per node",
                line=line,
                field="gpus_per_node",
                hint="the dgxc mapping prices the DGX H100 (8 per node)",
            )
        self.gpus_per_node = 8

    def setting(self, model: str, setting: str) -> tuple[int, str] | None:
        return self.settings.get((model, setting))

    def _embedding_and_loss_counted(self, model: str, args: dict[str, Any]) -> bool:
        """Whether the row's split is assumed to count the embedding and the loss as a layer each (`ASSUMED_SPLIT`):
        settings.csv marks the model's uneven split `not stated`, the layers do not divide over pp x vp, and the
        layers plus those two pieces do."""
        found = self.setting(model, "uneven_pipeline_stages")
        if not found or not found[1].lower().startswith("not stated"):
            return False
        layers, pp = args.get("num_layers"), args.get("pipeline_model_parallel_size") or 1
        vp = args.get("virtual_pipeline_model_parallel_size") or 1
        if not (type(layers) is int and type(pp) is int and type(vp) is int) or min(layers, pp, vp) < 1 or pp == 1:
            return False
        return bool(layers % (pp * vp)) and (layers + 2) % (pp * vp) == 0

    def translate(self, cells: dict[str, Any]) -> dict[str, Any]:
        model, precision = cells.get("model"), cells.get("precision")
        if model not in self.models:
            raise TraceError(
                self.models_path,
                f"has no row for model {model!r} of runs.csv",
                field="model",
                hint="the published models.csv lists every model of runs.csv",
            )
        if precision not in PRECISIONS:
            raise TraceError(
                self.models_path.parent / "runs.csv",
                f"precision {precision!r}",
                field="precision",
                hint=f"the set's precisions are {', '.join(PRECISIONS)}",
            )
        line, row = self.models[model]
        row_args = {COLUMNS[name]: value for name, value in cells.items() if name in COLUMNS and value != "NA"}
        args = {**STATED, **_architecture(self.models_path, line, row), **row_args}
        args["max_position_embeddings"] = args.get("seq_length")
        t = args.get("tensor_model_parallel_size")
        if type(t) is int and t > 0:  # Megatron's (and NeMo's) vocabulary padding to a multiple of 128 x t
            args["padded_vocab_size"] = padded_vocab(args.pop("vocab_size"), STATED["make_vocab_size_divisible_by"], t)
        for setting, arg in SETTINGS.items():
            found = self.setting(model, setting)
            stated = _switch(self.settings_path, found[0], setting, found[1]) if found else None
            if arg == "recompute_granularity":
                if stated and found:
                    raise TraceError(
                        self.settings_path,
                        f"says {found[1]!r}",
                        line=found[0],
                        field=setting,
                        hint="the dgxc mapping reads no recomputation method: extend it",
                    )
                args[arg] = None if stated is not None else ASSUMED[arg]
            else:
                args[arg] = stated if stated is not None else ASSUMED[arg]
        args["attention_dropout"] = args["hidden_dropout"] = ASSUMED["hidden_dropout"]
        found = self.setting(model, "dropout")
        if found and found[1].startswith("attention_dropout 0.1"):
            args["attention_dropout"] = args["hidden_dropout"] = 0.1
        if args.get("virtual_pipeline_model_parallel_size") is None:
            # a launch file's own -vp where the README table prints NA (Nemotron-4 340B)
            found = self.setting(model, "virtual_pipeline")
            if found and found[1].split(" ")[0].isdigit() and (args.get("pipeline_model_parallel_size") or 1) > 1:
                args["virtual_pipeline_model_parallel_size"] = int(found[1].split(" ")[0])
        if self._embedding_and_loss_counted(model, args):
            args["account_for_embedding_in_pipeline_split"] = True
            args["account_for_loss_in_pipeline_split"] = True
        if precision == "fp8":
            args["fp8_format"] = ASSUMED["fp8_format"]
            found = self.setting(model, "fp8_recipe")
            if found and "grad_reduce_in_fp32 = false" in found[1].lower():
                # NeMo's MegatronMixedPrecision(grad_reduce_in_fp32=False): megatron-core's DDP keeps and reduces the
                # gradients in the bf16 parameter dtype (DistributedDataParallelConfig.grad_reduce_in_fp32), what
                # Megatron-LM's --grad-reduce-in-bf16 launches (`model.memory.bf16_gradients`)
                args["grad_reduce_in_bf16"] = True
        step = cells.get("step_time_s")
        args["iteration_time_ms"] = (
            step * 1e3 if isinstance(step, (int, float)) and not isinstance(step, bool) else step
        )
        tokens, seq = cells.get("tokens_per_s_reported"), args.get("seq_length")
        if isinstance(tokens, (int, float)) and isinstance(seq, int) and seq > 0:
            args["samples_per_s"] = tokens / seq
        args["run_id"] = f"{TABLE_ID}_{model}_{precision}_g{cells.get('gpus')}"
        args["source"] = f"{cells.get('source_file')}, {model} {precision} on {cells.get('gpus')} GPUs"
        return args


def sweep_of(run_id: str) -> str:
    """The weak-scaling sweep (model and precision) a dgxc run id belongs to: its group."""
    return run_id.rsplit("_g", 1)[0]


def read_dgxc_table(path: Path | str) -> TableRead:
    """The dgxc runs as run-table runs (DGX H100, 8 per node), each sweep (model, precision) a group."""
    path = Path(path)
    mapping = Mapping(path)
    hardware = RunHardware(gpu=GPU, gpus_per_node=mapping.gpus_per_node)
    read = read_run_table(path, hardware=hardware, table_id=TABLE_ID, translate=mapping.translate, mapping=MAPPING)
    read.runs = [replace(run, group=sweep_of(run.run_id)) for run in read.runs]
    return read
