"""The verbs for writing a candidate: `terms` (the cost terms a candidate can change, their parameters and bounds)
and `candidate new` (a scaffold experiments/ID.toml)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer

from hops_calib.cli.options import MODEL_OPTION
from hops_calib.cli.output import EXIT_OK, guarded, print_json

app = typer.Typer(help="Candidate files (experiments/ID.toml): one term's change each.", no_args_is_help=True)


def terms(
    model: Path | None = MODEL_OPTION,
    as_json: bool = typer.Option(False, "--json", help="Print JSON (with every device constant's source)."),
) -> None:
    """The cost terms a candidate can add, remove or set: which are active, their parameters and bounds; devices."""
    raise typer.Exit(terms_command(model, as_json))


def terms_command(model_path: Path | None, as_json: bool) -> int:
    """Every cost term the package implements, whether the model activates it, and its parameters."""

    def run() -> int:
        from hops_calib.loop.model_files import default_model, load_model
        from hops_calib.model import TERMS

        model = load_model(model_path)
        rows: list[dict[str, Any]] = []
        for name, term in TERMS.items():
            active = model.active(name)
            values = active.params() if active else {}
            overrides = {n: v for n, v in values.items() if "@" in n}
            rows.append(
                {
                    "term": name,
                    "active": active is not None,
                    "summary": term.summary(),
                    "params": [
                        {
                            "name": p.name,
                            "value": values.get(p.name),
                            "default": p.default,
                            "low": p.low,
                            "high": p.high,
                            "unit": p.unit,
                            "doc": p.doc,
                            "per_device": p.per_device,
                            "choices": list(p.choices),
                            "by_device": {
                                n.partition("@")[2]: v for n, v in overrides.items() if n.partition("@")[0] == p.name
                            },
                        }
                        for p in term.params
                    ],
                }
            )
        devices = [
            {
                "type": d.type,
                "name": d.name,
                **{c: {"value": v, "source": d.source(c)} for c, v in d.constants().items()},
            }
            for d in model.devices
        ]
        if as_json:
            print_json(
                {
                    "model": str(model_path or default_model()),
                    "model_sha256": model.sha256,
                    "terms": rows,
                    "devices": devices,
                }
            )
            return EXIT_OK
        print(f"model {model.name} ({model_path or default_model()}), sha256 {model.sha256[:12]}")
        for row in rows:
            print(f"{'*' if row['active'] else ' '} {row['term']}: {row['summary']}")
            for p in row["params"]:
                value = "" if p["value"] is None else f" = {p['value']:g}"
                per_device = " per device type" if p["per_device"] else ""
                values_taken = (
                    f"one of {', '.join(f'{c:g}' for c in p['choices'])}"
                    if p["choices"]
                    else f"[{p['low']:g}, {p['high']:g}]"
                )
                print(
                    f"      {p['name']}{value} (default {p['default']:g}, {values_taken} "
                    f"{p['unit']}{per_device}): {p['doc']}"
                )
                for device, device_value in sorted(p["by_device"].items()):
                    print(f"        @{device} = {device_value:g}")
        print("  (* = active in this model)")
        for device in model.devices:
            print(
                f"device {device.type}: {device.name}: "
                + ", ".join(f"{c} {v:.4g}" for c, v in device.constants().items())
            )
        return EXIT_OK

    return guarded(run, as_json)


@app.command("new")
def candidate_new(
    term: str = typer.Argument(..., help="The cost term the candidate changes (see `hops-calib terms`)."),
    candidate_id: str | None = typer.Option(
        None, "--id", help="The candidate's id and file name (default: the next number in the folder, then the term)."
    ),
    folder: Path = typer.Option(Path("experiments"), "--dir", help="Where to write it."),
    model: Path | None = MODEL_OPTION,
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object (path, id, text)."),
    device: list[str] | None = typer.Option(
        None,
        "--device",
        help="Also write a per-device override NAME@TYPE for this device type (repeatable), for "
        "every parameter that takes one and has none for it yet, at its current value.",
    ),
) -> None:
    """Write a scaffold DIR/ID.toml for a one-term change: the term's parameters with the model's current values,
    defaults and bounds, and the hypothesis and grounding to fill in (evaluate refuses it until they are)."""
    raise typer.Exit(candidate_new_command(term, candidate_id, folder, model, as_json, tuple(device or ())))


def candidate_new_command(
    term: str,
    candidate_id: str | None,
    folder: Path,
    model_path: Path | None,
    as_json: bool,
    devices: tuple[str, ...] = (),
) -> int:
    def run() -> int:
        from hops_calib.loop.candidate import write_scaffold
        from hops_calib.loop.model_files import default_model, load_model

        model = load_model(model_path)
        path = write_scaffold(term, model, folder, candidate_id, devices)
        if as_json:
            print_json(
                {
                    "path": str(path),
                    "id": path.stem,
                    "term": term,
                    "model": str(model_path or default_model()),
                    "text": path.read_text(encoding="utf-8"),
                }
            )
        else:
            print(
                f"wrote {path}: fill in its hypothesis and grounding, keep only the values you change, then "
                f'hops-calib ledger plan --note "..." --candidate {path} and hops-calib evaluate {path} '
                "--fixtures DIR --plan N"
            )
        return EXIT_OK

    return guarded(run, as_json)
