#!/usr/bin/env bash
# One part of the GPU checks for the offload techniques, sized for one device call of at
# most 10 minutes. Run from the repository root on the GPU machine, with `.whl` carried
# (fill it here first with ../shared/device/wheels.sh):
#
#   bash scripts/gpu_session.sh PART      # logs go to $OUT (or ./gpu-logs)
#
# Parts (in the order worth spending device time on):
#   cuda-tests   every CUDA-only test except the race check (depth-independent memory,
#                swap ≥ 3× less activation memory, CUDA == CPU results)
#   races        asynchronous vs CUDA_LAUNCH_BLOCKING, and the CUDA sanitizer, per mode
#   modes        6.7B, 32k tokens/step: our modes against plain and checkpointing
#   zero3        6.7B: layer-major streaming against DeepSpeed ZeRO-3 + offload
#   zero2        6.7B: optimizer offload against DeepSpeed ZeRO-Offload, and FSDP2 offload
#   search       the largest trainable model per mode (host- and device-limited)
#   cpu-adam     the host optimizer step against DeepSpeedCPUAdam
#   planner      estimates against torch.cuda.max_memory_allocated and step time, and the
#                H100 predictions (benchmarks/planner.py --device cuda)
#   profile      `hybridtrain profile` of GPT-1.3B bf16 (device split, MFU vs the table,
#                memory timeline, Chrome trace) plain and with optimizer offload
#   memory       CUDA-only tests of device_memory_limit / oom_recovery / profiling, and a
#                run that recovers from a real CUDA OOM
set -euo pipefail
part=${1:?usage: scripts/gpu_session.sh PART}
out=${OUT:-gpu-logs}
mkdir -p "$out"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
fi
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/$part.log"
bench=(python3 benchmarks/offload.py --size 6.7b --seq-len 1024 --batch 4 --accumulation 8 --steps 3)
case $part in
  cuda-tests) python3 -m pytest -q -rs -k "cuda and not race" tests/runtime tests/parallel ;;
  races) python3 -m pytest -q -rs tests/runtime/test_stream_races.py ;;
  modes) "${bench[@]}" --modes plain checkpointing activation_swap optimizer_offload layer_major --no-baselines ;;
  zero3) "${bench[@]}" --modes layer_major --baselines deepspeed_zero3_offload ;;
  zero2) "${bench[@]}" --modes optimizer_offload --baselines deepspeed_zero_offload fsdp2_cpu_offload ;;
  search) "${bench[@]}" --search --search-only --modes plain optimizer_offload layer_major --search-budget-s 500 ;;
  cpu-adam) python3 benchmarks/cpu_adam.py --numel 200_000_000 ;;
  planner) python3 benchmarks/planner.py --device cuda ;;
  profile)
    common=(--set device=cuda --set model.name=gpt-1.3b --set bf16.enabled=true --set data.seq_len=1024
            --set train_micro_batch_size_per_gpu=4 --set train_batch_size=4 --steps 3)
    python3 -m hybridtrain.cli profile "${common[@]}" -o "$out/profile-plain"
    python3 -m hybridtrain.cli profile "${common[@]}" --set zero_optimization.stage=1 \
      --set zero_optimization.offload_optimizer.device=cpu -o "$out/profile-offload" ;;
  memory)
    python3 -m pytest -q -rs -k cuda tests/runtime/test_memory_limit.py tests/runtime/test_oom_recovery.py \
      tests/profiling tests/planner
    python3 -m hybridtrain.cli train --set device=cuda --set model.name=gpt-1.3b --set bf16.enabled=true \
      --set data.seq_len=1024 --set train_micro_batch_size_per_gpu=32 --set train_batch_size=32 --steps 3 \
      --set device_memory_limit=30GiB --set oom_recovery.enabled=true --output-dir "$out/oom-run" --no-progress ;;
  *) echo "unknown part: $part" >&2; exit 2 ;;
esac 2>&1 | tee -a "$out/$part.log"
