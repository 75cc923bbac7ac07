"""One GRPO step on P devices, for two designs, as a discrete-event model (scale_sim.py).

- `dagrl`: every device runs the same task list on its own shard (multi-controller). Data moves
  only in collectives between devices: the balance all_to_all, FSDP2's all-gathers and
  reduce-scatters, the weight-sync all-gather, the metric all-reduces.
- `single`: the verl pattern. The same device work, but after each worker-group call the driver
  gathers the whole batch (Ray object get: deserialise + copy), computes reward, advantage and
  the sequence-length balance itself, and scatters the batch for the next call (Ray object put:
  serialise + copy); the driver holds the global batch.

Costs, each stated in docs/scaling.md:
- device compute: FLOPs / (efficiency x device peak), efficiencies calibrated from dagrl's own
  profiler traces here (`Costs`); decode steps cost (fixed_rows + active rows) row-steps, so a
  device decodes until its longest response ends (the long tail);
- collectives: alpha-beta (ring all-gather / reduce-scatter / all-to-all: (P-1) alpha +
  (P-1)/P n beta; all-reduce of small metrics: 2 log2 P alpha), on the slowest link crossed;
- FSDP2 communication overlaps compute (it prefetches the next layer's all-gather) except one
  layer's worth per pass, unless `overlap=False`;
- host work (reward, advantage, the driver's serialisation and copies) runs on one CPU core per
  process at the rates measured here.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import numpy as np

from benchmarks.scale_presets import Hardware
from benchmarks.scale_sim import Sim, device_phases


class WorkloadError(ValueError):
    """A workload or cost parameter out of range (the message names it)."""


@dataclass(frozen=True)
class Workload:
    """Per-device work of one step (weak scaling: the same at every P). Defaults: a
    Qwen2.5-7B-sized GRPO step (28 layers, hidden 3584, 7.6e9 parameters)."""
    params: float = 7.6e9            # parameters in matmuls (N)
    layers: int = 28
    hidden: int = 3584
    prompts_per_device: int = 8
    samples_per_prompt: int = 8      # GRPO group size n
    prompt_len: int = 512
    max_response: int = 4096
    # Response lengths, cut at max_response: "lognormal" (median, sigma), a long tail; or
    # "geometric": every token ends the response with chance length_stop_prob (a random policy
    # and its EOS: the calibration workload).
    length_dist: str = "lognormal"
    length_median: float = 1024.0
    length_sigma: float = 0.9
    length_stop_prob: float = 0.0
    # Teacher-forced passes on [samples, prompt_len + the longest response] (dagrl's default
    # padded layout) instead of packed sequences without padding.
    padded: bool = False
    micro_batch_tokens: int = 16384  # tokens per forward/backward (token-budget micro-batches)
    param_bytes: int = 2             # bf16 weights: all-gathers, weight sync
    grad_bytes: int = 4              # fp32 gradient reduce-scatter
    ref: bool = True                 # a reference-model forward (KL term)
    bucket_bytes: int = 128 << 20    # weight-sync bucket (dagrl/engines/weight_sync.py)
    # Bytes that travel per sample: per prompt token and per response slot (verl's padded
    # DataProto layout, see sample_bytes()).
    bytes_per_prompt_token: float = 32.0
    bytes_per_response_token: float = 64.0
    # KV cache bytes per token (decode reads each row's): 2 (K, V) x layers x KV heads x head
    # dim x 2 bytes; Qwen2.5-7B: 2 x 28 x 4 x 128 x 2 (its config.json: GQA, 4 KV heads).
    kv_bytes_per_token: float = 57344.0
    # FSDP2 shard group (trainer.fsdp_shard_size): k = HSDP, shards over groups of k
    # consecutive ranks (8: a node), replicas across the groups; 0 = one group of every device.
    fsdp_shard_size: int = 8

    def __post_init__(self) -> None:
        for key in ("params", "layers", "hidden", "prompts_per_device", "samples_per_prompt",
                    "prompt_len", "max_response", "length_median", "length_sigma",
                    "micro_batch_tokens", "param_bytes", "grad_bytes", "bucket_bytes"):
            if not getattr(self, key) > 0:
                raise WorkloadError(f"workload.{key} must be > 0 (got {getattr(self, key)})")
        for key in ("kv_bytes_per_token", "fsdp_shard_size"):
            if getattr(self, key) < 0:
                raise WorkloadError(f"workload.{key} must be >= 0 (got {getattr(self, key)})")
        if self.length_median > self.max_response:
            raise WorkloadError("workload.length_median must be <= workload.max_response")
        if self.length_dist not in ("lognormal", "geometric"):
            raise WorkloadError(f"workload.length_dist must be lognormal or geometric "
                                f"(got {self.length_dist})")
        if self.length_dist == "geometric" and not 0 < self.length_stop_prob <= 1:
            raise WorkloadError("workload.length_stop_prob must be in (0, 1] (geometric)")

    @property
    def samples(self) -> int:
        return self.prompts_per_device * self.samples_per_prompt

    def sample_bytes(self) -> float:
        """Bytes of one sample in a gathered batch (prompt and response padded to their
        maxima, as verl's DataProto holds them)."""
        return (self.bytes_per_prompt_token * self.prompt_len
                + self.bytes_per_response_token * self.max_response)


@dataclass(frozen=True)
class Costs:
    """Rates calibrated on this machine (benchmarks/scale_calibrate.py).

    Device efficiencies are achieved FLOP/s over the device's peak, per kind of pass; the
    model assumes a target device reaches the same share of its peak (docs/scaling.md shows
    what changes if it does not). Host rates are seconds per token on one CPU core here."""
    eta_update: float
    eta_forward: float
    eta_decode: float
    decode_fixed_rows: float      # per-step cost of a decode step, in row-steps
    reward_s_per_token: float     # host: reward of one response token (decode + score)
    advantage_s_per_token: float  # host: advantage of one response token
    step_overhead_s: float        # host: per step, outside the nodes (loader, metrics)
    # CPU seconds FSDP2 adds to a worker's reference forward / update at these worker counts
    # (its collectives' copies, hooks, DTensor dispatch; measured on this machine's CPU
    # workers: applied only where devices are host processes, see Model.fsdp_host_s)
    fsdp_workers: tuple[int, ...] = ()
    fsdp_forward_overhead_s: tuple[float, ...] = ()
    fsdp_update_overhead_s: tuple[float, ...] = ()
    # How much slower than ideal time-sharing (max(1, P / cores)) a pass runs when P one-thread
    # processes outnumber the host's cores, at these P / cores ratios, per kind of pass
    # (measured on this machine; host presets only, see Model._slowdown). Empty: ideal.
    sharing_ratios: tuple[float, ...] = ()
    sharing_excess: dict[str, tuple[float, ...]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        n = len(self.fsdp_workers)
        if (len(self.fsdp_forward_overhead_s), len(self.fsdp_update_overhead_s)) != (n, n):
            raise WorkloadError("costs.fsdp_forward_overhead_s and costs.fsdp_update_overhead_s "
                                "need one value per costs.fsdp_workers entry")
        if any(w < 2 for w in self.fsdp_workers):
            raise WorkloadError(f"costs.fsdp_workers must be >= 2 (got {self.fsdp_workers})")
        for kind, values in self.sharing_excess.items():
            if len(values) != len(self.sharing_ratios) or any(v <= 0 for v in values):
                raise WorkloadError(f"costs.sharing_excess[{kind!r}] needs one value > 0 per "
                                    "costs.sharing_ratios entry")
        for key, value in asdict(self).items():
            if key.startswith(("fsdp_", "sharing_")):
                continue
            if key.startswith("eta_") and not 0 < value <= 1:
                raise WorkloadError(f"costs.{key} must be in (0, 1] (got {value})")
            if value < 0:
                raise WorkloadError(f"costs.{key} must be >= 0 (got {value})")


@dataclass(frozen=True)
class DriverCosts:
    """The single controller's driver, fitted from the Ray emulation here."""
    get_s_per_object: float
    get_s_per_byte: float
    put_s_per_object: float
    put_s_per_byte: float
    copy_s_per_byte: float
    mem_base_bytes: float
    mem_per_batch_byte: float      # driver RSS growth per byte of the global batch

    def __post_init__(self) -> None:
        for key, value in asdict(self).items():
            if value < 0:
                raise WorkloadError(f"driver.{key} must be >= 0 (got {value})")


@dataclass
class StepResult:
    design: str
    devices: int
    seconds: float
    breakdown: dict[str, float]          # critical-path seconds per category
    driver_peak_bytes: float = 0.0
    replicates: list[float] = field(default_factory=list)
    # per dagrl task (timing/<name>_s): the slowest device's time from the end of its previous
    # task to the end of this one, waits included, as dagrl's observer measures it
    phases: dict[str, float] = field(default_factory=dict)


# The model's tasks under the names dagrl's observer logs them (timing/<name>_s).
PHASE_OF = {"rollout": "rollout", "reward": "reward", "ref forward": "ref_logprob",
            "ref all-gathers": "ref_logprob", "advantage": "advantage",
            "balance all_to_all": "balance_actor_update", "actor update": "actor_update",
            "update all-gathers/reduce-scatters": "actor_update",
            "weight sync all-gather": "weight_sync"}


# --- FLOPs ------------------------------------------------------------------------------------
def seq_flops(w: Workload, seq: np.ndarray) -> np.ndarray:
    """Forward FLOPs of teacher-forced sequences of lengths `seq`: 2N per token plus causal
    attention, 2 x layers x hidden x s^2 (QK^T and AV over half the context on average)."""
    seq = seq.astype(np.float64)
    return 2.0 * w.params * seq + 2.0 * w.layers * w.hidden * seq * seq


def decode_flops(w: Workload, lengths: np.ndarray) -> float:
    """Decode FLOPs of one device's responses: 2N per token plus attention over the context
    (prompt + tokens so far), 4 x layers x hidden x context per token."""
    lengths = lengths.astype(np.float64)
    ctx = w.prompt_len * lengths + lengths * (lengths + 1) / 2
    return float(2.0 * w.params * lengths.sum() + 4.0 * w.layers * w.hidden * ctx.sum())


def draw_lengths(w: Workload, rng: np.random.Generator, n: int) -> np.ndarray:
    if w.length_dist == "geometric":
        raw = rng.geometric(w.length_stop_prob, n)
    else:
        raw = np.rint(rng.lognormal(math.log(w.length_median), w.length_sigma, n))
    return np.clip(raw, 1, w.max_response).astype(np.int64)


def forward_flops(w: Workload, lengths: np.ndarray, longest: int | None = None) -> float:
    """Forward FLOPs of a teacher-forced pass over one device's samples: packed, each sequence
    its own length; padded, every row as long as the longest (`longest`, default its own)."""
    if w.padded:
        longest = int(lengths.max()) if longest is None else longest
        return float(len(lengths) * seq_flops(w, np.array([w.prompt_len + longest]))[0])
    return float(seq_flops(w, w.prompt_len + lengths).sum())


# --- collectives (alpha-beta) -------------------------------------------------------------------
def ring(hw: Hardware, p: int, nbytes: float, stride: int = 1) -> float:
    """All-gather / reduce-scatter / all-to-all of `nbytes` per device (total output of the
    all-gather, total input of the reduce-scatter, total sent by the all-to-all), ring or
    pairwise-exchange algorithm: P-1 steps, over `p` devices `stride` ranks apart."""
    if p <= 1:
        return 0.0
    alpha, beta = hw.link(p, stride)
    return (p - 1) * alpha + (p - 1) / p * nbytes * beta


def small_allreduce(hw: Hardware, p: int) -> float:
    """A few floats reduced over P devices: latency only (recursive doubling, twice)."""
    if p <= 1:
        return 0.0
    alpha, _ = hw.link(p)
    return 2 * math.ceil(math.log2(p)) * alpha


@dataclass(frozen=True)
class Options:
    overlap: bool = True          # FSDP2 prefetch hides all-gathers behind compute
    driver_reward: bool = True    # single controller scores on the driver (verl's fit loop)
    balance_before_forward: bool = False   # what-if: dagrl balances tokens before ref too
    replicates: int = 8
    # At small P a step's time varies with the few devices' response lengths, and T(1) is
    # every efficiency's denominator: at least this many device-steps per point (P=1: 2048
    # replicates, P >= 256: `replicates`), so the Monte Carlo error of T(1) stays well under 1%.
    min_device_steps: int = 2048
    seed: int = 0


class Model:
    """The two designs on one workload and one machine."""

    def __init__(self, w: Workload, hw: Hardware, costs: Costs, driver: DriverCosts,
                 options: Options | None = None) -> None:
        self.w, self.hw, self.c, self.d = w, hw, costs, driver
        self.o = options or Options()

    # per-device compute -----------------------------------------------------------------------
    def _slowdown(self, p: int, kind: str = "") -> float:
        """Workers that share host cores (the local preset) run slower when they outnumber
        them: P / cores, times what this host's time-sharing measurably adds for `kind` of
        pass (Costs.sharing_excess); accelerators each have their own compute."""
        if not self.hw.host_cores:
            return 1.0
        ratio = p / self.hw.host_cores
        excess = self.c.sharing_excess.get(kind)
        # one process alone is the reference (excess 1); between the measured ratios, linear
        extra = (float(np.interp(ratio, (1.0 / self.hw.host_cores, *self.c.sharing_ratios),
                                 (1.0, *excess))) if excess and p > 1 else 1.0)
        return max(1.0, ratio) * extra

    def _rate(self, eta: float, p: int, kind: str) -> float:
        return eta * self.hw.flops / self._slowdown(p, kind)

    def rollout_s(self, lengths: np.ndarray, p: int) -> float:
        """Prefill once per prompt (a group shares it) plus decode until the longest response
        of this device ends: (fixed_rows x max length + sum of lengths) row-steps."""
        w, c = self.w, self.c
        prefill = float(seq_flops(w, np.full(w.prompts_per_device, w.prompt_len)).sum())
        decode = decode_flops(w, lengths)
        row_step = decode / max(1, int(lengths.sum()))     # FLOPs of one row-step
        fixed = c.decode_fixed_rows * int(lengths.max()) * row_step
        compute = (decode + fixed) / self._rate(c.eta_decode, p, "decode")
        return (prefill / self._rate(c.eta_forward, p, "forward")
                + max(compute, self.decode_memory_s(lengths)))

    def decode_memory_s(self, lengths: np.ndarray) -> float:
        """Decode's memory traffic at the device's memory bandwidth: the weights once per
        decode step (until the longest response ends) and each row's KV cache (prompt + tokens
        so far) once per token it generates. 0 where memory bandwidth is not modelled."""
        hw, w = self.hw, self.w
        if not hw.mem_bw:
            return 0.0
        lengths = lengths.astype(np.float64)
        kv_tokens = float((w.prompt_len * lengths + lengths * (lengths + 1) / 2).sum())
        nbytes = int(lengths.max()) * w.params * w.param_bytes + kv_tokens * w.kv_bytes_per_token
        return nbytes / (hw.mem_bw * hw.mem_efficiency)

    def _micro_batches(self, tokens: float) -> int:
        return max(1, math.ceil(tokens / self.w.micro_batch_tokens))

    def fsdp_exposed_s(self, p: int, compute_s: float, tokens: float, backward: bool) -> float:
        """FSDP2 communication of one pass over the model, per micro-batch: an all-gather per
        layer (forward; again in backward, as parameters are resharded after forward) and a
        gradient reduce-scatter per layer in backward. Exposed: what compute cannot hide
        (one layer's worth always), or all of it without overlap."""
        if p <= 1:
            return 0.0
        w, s = self.w, self.shard_size(p)
        layer = w.params / w.layers
        per_layer = ring(self.hw, s, layer * w.param_bytes)
        if backward:
            # HSDP: after the reduce-scatter in its group, each device all-reduces its gradient
            # shard with the devices holding the same shard in the other groups (2 rings).
            replicas = 2 * ring(self.hw, p // s, layer * w.grad_bytes / s, stride=s)
            per_layer = 2 * per_layer + ring(self.hw, s, layer * w.grad_bytes) + replicas
        micro = self._micro_batches(tokens)
        comm = micro * w.layers * per_layer
        if not self.o.overlap:
            return comm
        return max(0.0, comm - compute_s) + micro * per_layer

    def fsdp_host_s(self, p: int, kind: str) -> float:
        """FSDP2's own CPU work in a `kind` pass ("forward" or "update") of a worker, where the
        devices are host processes (the local preset): measured at 2 and 4 workers, linear in
        between, held beyond. On accelerators this host work runs ahead of the device's queued
        kernels and is not added (an assumption, docs/scaling.md)."""
        c = self.c
        if p <= 1 or not self.hw.host_cores or not c.fsdp_workers:
            return 0.0
        ys = c.fsdp_forward_overhead_s if kind == "forward" else c.fsdp_update_overhead_s
        return float(np.interp(p, (1, *c.fsdp_workers), (0.0, *ys))) * self._slowdown(p)

    def shard_size(self, p: int) -> int:
        """Devices one FSDP2 shard group spans at `p` devices."""
        s = self.w.fsdp_shard_size
        if not s or s >= p:
            return p
        if p % s:
            raise WorkloadError(f"workload.fsdp_shard_size={s} does not divide {p} devices")
        return s

    def weight_sync_s(self, p: int) -> float:
        """Every device gathers the full weights into its rollout engine, bucket by bucket,
        from the devices of its shard group."""
        s = self.shard_size(p)
        if s <= 1:
            return 0.0
        total = self.w.params * self.w.param_bytes
        buckets = math.ceil(total / self.w.bucket_bytes)
        alpha, beta = self.hw.link(s)
        return buckets * (s - 1) * alpha + (s - 1) / s * total * beta

    # one step ---------------------------------------------------------------------------------
    def _host(self, seconds: float, p: int) -> float:
        """Host work of a worker (reward, advantage, loop overhead): one core each, shared when
        workers outnumber the cores (local preset)."""
        return seconds * self._slowdown(p)

    def step(self, design: str, p: int, rng: np.random.Generator) -> tuple[Sim, float]:
        """Simulate one step; returns the simulation and the driver's peak memory (single)."""
        if design not in ("dagrl", "single"):
            raise WorkloadError(f"design must be dagrl or single (got {design})")
        w, c, d = self.w, self.c, self.d
        single, drv = design == "single", ("driver",)
        sim = Sim()
        devs = [("dev", i) for i in range(p)]
        lengths = [draw_lengths(w, rng, w.samples) for _ in range(p)]
        resp = [float(x.sum()) for x in lengths]                     # response tokens
        fwd = [forward_flops(w, x) for x in lengths]
        shard_bytes = w.samples * w.sample_bytes()
        lp_bytes = w.samples * 4.0 * w.max_response                   # float32 log-probs, padded
        batch_bytes = p * (shard_bytes + lp_bytes)
        prompt_bytes = w.samples * w.bytes_per_prompt_token * w.prompt_len

        ready = [sim.add("step start", "overhead", [dev], self._host(c.step_overhead_s, p))
                 for dev in devs]
        if single:   # the driver puts each worker's prompts into the object store
            put = sim.add("put prompts", "driver:serialize", drv,
                          p * d.put_s_per_object + p * prompt_bytes * d.put_s_per_byte)
            ready = [sim.add("get prompts", "worker:serialize", [dev],
                             prompt_bytes * d.get_s_per_byte, deps=(put, r))
                     for dev, r in zip(devs, ready, strict=True)]
        ready = [sim.add("rollout", "rollout", [dev], self.rollout_s(lengths[i], p),
                         deps=(ready[i],)) for i, dev in enumerate(devs)]

        on_driver = single and self.o.driver_reward
        # Token balance before the forward passes: verl balances right after generation (its
        # driver reorders the batch); dagrl's plan balances before actor_update only, so its
        # reference pass runs on each device's own, unbalanced shard (`balance_before_forward`
        # models moving dagrl's balance up).
        early = single or self.o.balance_before_forward
        if single:
            got = self._gather(sim, devs, ready, shard_bytes, "rollout output")
            # verl's _balance_batch reorders the whole batch on the driver: one copy.
            got = sim.add("balance (driver)", "driver:copy", drv,
                          p * shard_bytes * d.copy_s_per_byte, deps=(got,))
            if on_driver:   # verl's fit loop scores the whole batch in the driver process
                got = sim.add("reward (driver)", "driver:reward", drv,
                              sum(resp) * c.reward_s_per_token, deps=(got,))
            ready = self._scatter(sim, devs, got, shard_bytes, "ref input")
        if not on_driver:
            ready = [sim.add("reward", "reward", [dev],
                             self._host(resp[i] * c.reward_s_per_token, p), deps=(ready[i],))
                     for i, dev in enumerate(devs)]
        if early and not single:
            ready = [sim.add("balance all_to_all", "all_to_all", devs,
                             self._balance_s(p, shard_bytes), deps=ready)] * p

        # After a balance every device holds a near-equal share of the tokens (its bound is
        # one group), so each does the mean work; padded rows are as long as the longest
        # response of the step (the balance mixes every device's samples).
        longest = max(int(x.max()) for x in lengths)
        balanced = float(np.mean([forward_flops(w, x, longest) for x in lengths]))
        if w.ref:
            compute = [(balanced if early else f) / self._rate(c.eta_forward, p, "forward")
                       + self.fsdp_host_s(p, "forward") for f in fwd]
            ref = [sim.add("ref forward", "forward", [dev], compute[i], deps=(ready[i],))
                   for i, dev in enumerate(devs)]
            # FSDP all-gathers are collective: devices advance together, at the slowest's pace.
            tokens = w.samples * w.prompt_len + max(resp)
            exposed = self.fsdp_exposed_s(p, min(compute), tokens, backward=False)
            ready = [sim.add("ref all-gathers", "fsdp", devs, exposed, deps=ref)] * p

        if single:
            got = self._gather(sim, devs, ready, lp_bytes, "ref log-probs")
            got = sim.add("advantage (driver)", "driver:advantage", drv,
                          sum(resp) * c.advantage_s_per_token, deps=(got,))
            got = sim.add("union (driver)", "driver:copy", drv,
                          p * lp_bytes * d.copy_s_per_byte, deps=(got,))
            ready = self._scatter(sim, devs, got, shard_bytes + lp_bytes, "update input")
        else:
            adv = [sim.add("advantage", "advantage", [dev],
                           self._host(resp[i] * c.advantage_s_per_token, p), deps=(ready[i],))
                   for i, dev in enumerate(devs)]
            # balance before the update: sizes and token counts, then whole groups move (when
            # the shards are balanced already, nothing moves: only the counts are exchanged).
            moved = 0.0 if early else shard_bytes + lp_bytes
            ready = [sim.add("balance all_to_all", "all_to_all", devs,
                             self._balance_s(p, moved), deps=adv)] * p

        compute_s = (3.0 * balanced / self._rate(c.eta_update, p, "update")
                     + self.fsdp_host_s(p, "update"))
        upd = [sim.add("actor update", "update", [dev], compute_s, deps=(ready[i],))
               for i, dev in enumerate(devs)]
        tokens = w.samples * w.prompt_len + float(np.mean(resp))
        exposed = self.fsdp_exposed_s(p, compute_s, tokens, backward=True)
        last = sim.add("update all-gathers/reduce-scatters", "fsdp", devs, exposed, deps=upd)
        last = sim.add("weight sync all-gather", "weight_sync", devs, self.weight_sync_s(p),
                       deps=(last,))
        last = sim.add("metrics all-reduce", "metrics", devs, 3 * small_allreduce(self.hw, p),
                       deps=(last,))
        if single:   # the driver collects each worker's metrics (one small object each)
            sim.add("get metrics", "driver:serialize", drv, p * d.get_s_per_object, deps=(last,))
        peak = d.mem_base_bytes + d.mem_per_batch_byte * batch_bytes if single else 0.0
        return sim, peak

    def _balance_s(self, p: int, moved: float) -> float:
        """dagrl's balance: the sizes all_to_all and the token counts' all_gather (latency),
        then `moved` bytes per device in one all_to_all, packed and unpacked on the host when
        the devices are host processes. Nothing with 1 worker (no balance task)."""
        if p <= 1:
            return 0.0
        return (ring(self.hw, p, moved) + 2 * ring(self.hw, p, 8.0 * p)
                + self._host_copy(p, moved))

    def _host_copy(self, p: int, nbytes: float) -> float:
        """Packing and unpacking an exchange on the host (only where devices are host
        processes: on accelerators the buffer is packed in device memory)."""
        if not self.hw.host_cores:
            return 0.0
        return 2 * nbytes * self.d.copy_s_per_byte * self._slowdown(p)

    def _gather(self, sim: Sim, devs, deps, shard_bytes: float, what: str) -> int:
        """Workers serialise their outputs (in parallel); the driver gets and deserialises each
        one and concatenates them (one copy); the bytes cross the driver node's NIC."""
        d, p = self.d, len(devs)
        ser = [sim.add(f"put {what}", "worker:serialize", [dev], shard_bytes * d.put_s_per_byte,
                       deps=(deps[i],)) for i, dev in enumerate(devs)]
        total = p * shard_bytes
        cpu = p * d.get_s_per_object + total * d.get_s_per_byte
        got = sim.add(f"get {what}", "driver:serialize", ("driver",),
                      max(cpu, total / self.hw.driver_nic), deps=ser)
        return sim.add(f"concat {what}", "driver:copy", ("driver",), total * d.copy_s_per_byte,
                       deps=(got,))

    def _scatter(self, sim: Sim, devs, dep: int, shard_bytes: float, what: str) -> list[int]:
        """The driver puts one chunk per worker (serialise + store); each worker gets its own."""
        d, p = self.d, len(devs)
        total = p * shard_bytes
        cpu = p * d.put_s_per_object + total * d.put_s_per_byte
        put = sim.add(f"put {what}", "driver:serialize", ("driver",),
                      max(cpu, total / self.hw.driver_nic), deps=(dep,))
        return [sim.add(f"get {what}", "worker:serialize", [dev], shard_bytes * d.get_s_per_byte,
                        deps=(put,)) for dev in devs]

    def run(self, design: str, p: int) -> StepResult:
        """Mean over replicates (each with its own response lengths) of the step time."""
        rng = np.random.default_rng(self.o.seed * 1_000_003 + p)
        times, paths, phases, peak = [], [], [], 0.0
        for _ in range(max(self.o.replicates, math.ceil(self.o.min_device_steps / p))):
            sim, peak = self.step(design, p, rng)
            times.append(sim.end())
            paths.append(sim.critical_path())
            phases.append(device_phases(sim, PHASE_OF))

        def mean(parts: list[dict]) -> dict[str, float]:
            keys = sorted({k for part in parts for k in part})
            return {k: float(np.mean([part.get(k, 0.0) for part in parts])) for k in keys}

        return StepResult(design, p, float(np.mean(times)), mean(paths), peak, times,
                          mean(phases))
