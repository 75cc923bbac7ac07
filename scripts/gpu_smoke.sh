#!/usr/bin/env bash
# GPU smoke test: what CI on CPUs cannot run.
#
#   scripts/gpu_smoke.sh            # from the repository root, in dagrl's environment
#   PYTHON=/path/to/python scripts/gpu_smoke.sh
#
# With 2+ CUDA devices: one GRPO training step on 2 processes under torchrun, FSDP2 over NCCL
# (trainer.device=cuda), checked to write its metrics, and two with FSDP2 CPU offload
# (actor.offload, ref.offload) and a checkpoint. With 1+ CUDA device and vLLM installed:
# one training step with rollout.backend=vllm (the engine in the worker process, weights synced
# after the update). Each part that cannot run says why and is skipped; with no CUDA device at
# all the script prints one "skip" line and exits 0. Any part that runs and fails exits 1.
# Record the result in docs/scaling.md (GPU smoke section) whenever a GPU was available.
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python}"
OUT="$(mktemp -d "${TMPDIR:-/tmp}/dagrl-gpu-smoke-XXXXXX")"
trap 'rm -rf "$OUT"' EXIT

gpus="$("$PY" -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)' 2>/dev/null || echo 0)"
if [[ "$gpus" == "0" ]]; then
    echo "skip: no CUDA device visible to torch ($("$PY" -c 'import torch; print("torch", torch.__version__)' 2>/dev/null || echo 'torch not importable')); nothing to smoke-test"
    exit 0
fi
"$PY" -c 'import torch; print("cuda devices:", [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())], "torch", torch.__version__, "nccl", torch.cuda.nccl.version())'

# A few seconds per step on any GPU: the built-in tiny model and arithmetic task.
STEP=(trainer.total_steps=1 trainer.device=cuda logging.progress_bar=false
      data.train_batch_size=8 actor.mini_batch_size=8 rollout.n=4 rollout.max_new_tokens=8)
failed=0

check_metrics() {   # $1: run dir, $2: label
    if [[ -s "$1/metrics.jsonl" ]] && grep -q '"actor/pg_loss"' "$1/metrics.jsonl"; then
        echo "ok: $2 ($(head -c 300 "$1/metrics.jsonl"))"
    else
        echo "FAILED: $2 (no metrics in $1)"; failed=1
    fi
}

if (( gpus >= 2 )); then
    port="$("$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
    if "$PY" -m torch.distributed.run --nproc-per-node 2 --master-port "$port" -m dagrl.train \
        trainer.n_workers=2 "trainer.run_dir=$OUT/fsdp2" "${STEP[@]}"; then
        check_metrics "$OUT/fsdp2" "2-process FSDP2 + NCCL training step"
    else
        echo "FAILED: 2-process FSDP2 + NCCL training step"; failed=1
    fi
    # FSDP2 CPU offload: shards on the host, copied to the GPU per unit; two steps with a
    # checkpoint (DCP of host shards), weight sync to the rollout and grad clipping over gloo
    port="$("$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
    if "$PY" -m torch.distributed.run --nproc-per-node 2 --master-port "$port" -m dagrl.train \
        trainer.n_workers=2 "trainer.run_dir=$OUT/offload" actor.offload=true ref.offload=true \
        trainer.save_every=1 "${STEP[@]}" trainer.total_steps=2; then
        check_metrics "$OUT/offload" "2-process FSDP2 with actor.offload + ref.offload"
    else
        echo "FAILED: 2-process FSDP2 with actor.offload + ref.offload"; failed=1
    fi
else
    echo "skip: 2-process FSDP2 + NCCL steps need 2 CUDA devices (found $gpus)"
fi

# One GPU: a training step per feature family in one worker on the device (float32; bfloat16
# mixed precision with LoRA; PPO's critic; the memory features), then a larger model for a few
# steps beside `dagrl plan --memory`'s estimate of it (its peak is read from the metrics).
one_gpu_step() {   # $1: label, $2: run dir name, rest: overrides
    local label="$1" name="$2"; shift 2
    if "$PY" -m dagrl.cli train "trainer.run_dir=$OUT/$name" "${STEP[@]}" "$@"; then
        check_metrics "$OUT/$name" "$label"
        # A step that ran on the host has no device memory (the 1-worker launch once ignored
        # trainer.device and trained on the CPU of a GPU machine).
        grep -q '"memory/device_peak_gb"' "$OUT/$name/metrics.jsonl" \
            || { echo "FAILED: $label ran on the host, not the GPU"; failed=1; }
    else
        echo "FAILED: $label"; failed=1
        tail -n 12 "$OUT/$name/dagrl.log" 2>/dev/null   # the traceback's end
    fi
}
one_gpu_step "1 worker on the GPU, float32" gpu1
one_gpu_step "1 worker, bfloat16 mixed precision + LoRA" gpu1-lora model.mixed_precision=bfloat16 \
    actor.lora.rank=8
one_gpu_step "1 worker, PPO (critic)" gpu1-ppo algorithm.name=ppo
one_gpu_step "1 worker, checkpointing + packing + chunked LM head" gpu1-mem \
    actor.activation_checkpointing=true model.pack_sequences=true actor.logits_chunk_tokens=4
# The composed recipes of issue 34 in one worker on the device: multi-turn (gapped masks, turn
# rewards), a judge, DAPO's filter, validation and the profiler; tools with two policies, LoRA and
# PPO's critic.
MT=(rollout.multi_turn.enable=true rollout.multi_turn.format=tiny rollout.multi_turn.max_turns=3)
one_gpu_step "1 worker, environment + judge + DAPO + validation + profiler" gpu1-env "${MT[@]}" \
    rollout.multi_turn.environment=guess_number data.train_files=[builtin:guess-number] \
    data.max_prompt_length=32 rollout.max_new_tokens=32 rollout.multi_turn.max_tokens_per_turn=3 \
    reward.source=judge judge.path=builtin:tiny-qwen2 judge.backend=hf \
    "judge.template=q {prompt} a {response}" 'judge.score_pattern=(\d)' judge.max_new_tokens=4 \
    judge.score_scale=9 algorithm.name=dapo data.val_files=[builtin:arith] trainer.val_every=1 \
    profiler.enable=true
one_gpu_step "1 worker, tools + two policies + LoRA + PPO" gpu1-agents "${MT[@]}" \
    rollout.multi_turn.tools=[calculator] rollout.max_new_tokens=16 \
    rollout.multi_turn.max_tokens_per_turn=6 actor.lora.rank=8 algorithm.name=ppo \
    dag.graph=examples/two_policies.graph.yaml models.refiner.model.path=builtin:tiny-llama \
    models.refiner.rollout.max_new_tokens=6 algorithm.kl_loss_coef=0
BIG=(model.tiny_hidden_size=1024 model.tiny_layers=12 model.mixed_precision=bfloat16
     data.train_batch_size=32 actor.mini_batch_size=32 rollout.n=8 rollout.max_new_tokens=64
     actor.micro_batch_size=64 ref.micro_batch_size=64)
"$PY" -m dagrl.cli plan --memory "${STEP[@]}" "${BIG[@]}" 2>&1 | sed -n '/memory/,$p'
one_gpu_step "1 worker, 1024-wide 12-layer model, 3 steps" gpu1-big "${BIG[@]}" trainer.total_steps=3
"$PY" - "$OUT/gpu1-big/metrics.jsonl" <<'PYEOF' || true
import json, sys
for line in open(sys.argv[1]):
    row = json.loads(line)
    keep = {k: v for k, v in row.items() if k.startswith(("timing/", "memory/", "perf/")) or k in
            ("step", "reward/mean", "actor/pg_loss")}
    print(json.dumps(keep, sort_keys=True))
PYEOF

if "$PY" -c 'import vllm' 2>/dev/null; then
    if "$PY" -m dagrl.cli train "trainer.run_dir=$OUT/vllm" rollout.backend=vllm \
        rollout.vllm.gpu_memory_utilization=0.3 model.tiny_hidden_size=128 "${STEP[@]}"; then
        check_metrics "$OUT/vllm" "vLLM rollout backend, 1 worker"
    else
        echo "FAILED: vLLM rollout backend"; failed=1
    fi
else
    echo "skip: vLLM backend: vllm is not installed (pip install -e '.[vllm]')"
fi
exit "$failed"
