"""Build the DeepSpeed ops the offload benchmark's peers load, before any timed part: CPU Adam
(ZeRO-Offload's and ZeRO-3 offload's host step) and, on DeepSpeed's CPU accelerator (the dry
run), its shared-memory collectives, which ``deepspeed.initialize`` builds on that accelerator."""

from __future__ import annotations

import time

from deepspeed.accelerator import get_accelerator


def main() -> None:
    """Load (building where not cached) each op; print what took how long."""
    accelerator = get_accelerator()
    names = ["CPUAdamBuilder"] + (["ShareMemCommBuilder"] if accelerator.device_name() == "cpu" else [])
    for name in names:
        start = time.perf_counter()
        builder = accelerator.create_op_builder(name)
        if builder is None:
            print(f"{name}: not on the {accelerator.device_name()} accelerator", flush=True)
            continue
        builder.load()
        print(f"{name}: loaded in {time.perf_counter() - start:.1f} s", flush=True)


if __name__ == "__main__":
    main()
