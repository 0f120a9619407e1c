"""The config reference, generated from the schema's field docstrings (docs/configuration.md)."""

from __future__ import annotations

import json

from pydantic import BaseModel

from hybridtrain.config.deepspeed_keys import AUTO_RESOLVED, TREATMENTS
from hybridtrain.config.schema import Config


def config_reference() -> str:
    """Markdown tables of every key (name, type, default, description), then the treatment
    of every DeepSpeed key that is not one of them."""
    lines: list[str] = []
    _section(Config, "", lines)
    _deepspeed_keys(lines)
    return "\n".join(lines)


def _deepspeed_keys(lines: list[str]) -> None:
    lines += ["#### DeepSpeed keys", "",
              "Every DeepSpeed key above is implemented with DeepSpeed's meaning. The others are renamed "
              "(legacy names), accepted",
              "without effect (said once at info level), or refused when they would change the math — all "
              "refusals of a file in one",
              "line. `\"auto\"` is resolved as listed, or refused naming its key.", "",
              "| DeepSpeed key | treatment | meaning |", "|---|---|---|"]
    for key, treatment in sorted(TREATMENTS.items()):
        kind = {"renamed": f"renamed → `{treatment.target}`", "no_effect": "no effect here",
                "refused": "refused" + (" (for the values noted)" if treatment.when else "")}[treatment.kind]
        lines.append(f"| `{key}` | {kind} | {_one_line(treatment.note)} |")
    lines += ["", "| `\"auto\"` of | resolved to |", "|---|---|"]
    for key, (_, why) in sorted(AUTO_RESOLVED.items()):
        lines.append(f"| `{key}` | {_one_line(why)} |")
    lines += ["| anything else (`optimizer.params.lr`, `scheduler.params.warmup_num_steps` …) | refused: only "
              "the Trainer's arguments determine it |", ""]


def _section(model: type[BaseModel], prefix: str, lines: list[str]) -> None:
    nested: list[tuple[str, type[BaseModel]]] = []
    title = prefix.rstrip(".") or "top level"
    lines += [f"#### `{title}`" if prefix else f"#### {title}", "", (model.__doc__ or "").strip(), "",
              "| key | type | default | meaning |", "|---|---|---|---|"]
    for name, info in model.model_fields.items():
        candidates = [info.annotation, *getattr(info.annotation, "__args__", ())]
        sub = next((c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)), None)
        if sub is not None:
            nested.append((prefix + name + ".", sub))
            lines.append(f"| `{prefix}{name}` | section | | {_one_line(info.description)} |")
            continue
        type_name = str(info.annotation).replace("typing.", "").replace("<class '", "").replace("'>", "")
        default = info.get_default(call_default_factory=True)
        lines.append(f"| `{prefix}{name}` | {type_name} | `{json.dumps(default)}` | {_one_line(info.description)} |")
    lines.append("")
    for sub_prefix, sub_model in nested:
        _section(sub_model, sub_prefix, lines)


def _one_line(text: str | None) -> str:
    return " ".join((text or "").split()).replace("|", "\\|")


if __name__ == "__main__":
    print(config_reference())
