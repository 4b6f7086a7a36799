"""What a request costs a simulated SGLang worker, in seconds, from named hardware and model
figures (docs/COST_MODEL.md gives each figure's source and the arithmetic).

Defaults: Llama-3.1-8B in bf16 on one H100 SXM, host RAM over PCIe Gen5, a Mooncake pool
read over RDMA. Every figure is a flag of `kvtier sim-worker` and `kvtier bench replay`.

- Prefill: recomputed tokens / `prefill_tokens_per_s`.
- Load back (host -> GPU): the pages' KV bytes / `host_to_device_gb_s`.
- L3 (Mooncake -> host -> GPU): the pages' KV bytes / `l3_read_gb_s`, then the load back.
- Decode runs in batches: one step reads the weights and every running sequence's KV once,
  step = (weight bytes + context tokens x KV bytes per token) / `hbm_gb_s`. SGLang's scheduler
  runs a waiting prefill before the next decode step, so a prefill that arrives while the
  engine decodes waits for the step in progress, and decode never delays a prefill more.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

GB = 1e9
#: The figures a worker's speed factor scales: what its GPU computes and what its links move
#: (a slower card, a different TP size, a throttled one). Decode is left as it is.
SPEED_SCALED = ("prefill_tokens_per_s", "host_to_device_gb_s", "l3_read_gb_s")


@dataclass(frozen=True)
class CostModel:
    #: Llama-3.1-8B: 2 (K and V) x 32 layers x 8 KV heads x 128 dims x 2 bytes (bf16).
    kv_bytes_per_token: int = 131072
    #: Prefill throughput of one GPU for the model (tokens/s).
    prefill_tokens_per_s: float = 20000.0
    #: Host RAM -> GPU copy bandwidth (GB/s) that HiCache's load back achieves.
    host_to_device_gb_s: float = 25.0
    #: Mooncake pool -> host RAM read bandwidth per GPU (GB/s).
    l3_read_gb_s: float = 20.0
    #: Model weights read once per decode step (bytes): 8.03e9 parameters x 2 bytes.
    weight_bytes: float = 16.06e9
    #: Effective GPU memory bandwidth during decode (GB/s).
    hbm_gb_s: float = 2500.0

    def __post_init__(self) -> None:
        for name in ("kv_bytes_per_token", "prefill_tokens_per_s", "host_to_device_gb_s", "l3_read_gb_s", "hbm_gb_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.weight_bytes < 0:
            raise ValueError(f"weight_bytes must be >= 0, got {self.weight_bytes}")

    def at_speed(self, factor: float) -> CostModel:
        """This model on a worker `factor` times as fast at prefill and load back (0.5: half)."""
        if not factor > 0:
            raise ValueError(f"a worker's speed factor must be > 0, got {factor}")
        if factor == 1.0:
            return self
        return replace(self, **{name: getattr(self, name) * factor for name in SPEED_SCALED})

    def prefill_s(self, tokens: int) -> float:
        return tokens / self.prefill_tokens_per_s

    def load_back_s(self, pages: int, page_size: int) -> float:
        return pages * page_size * self.kv_bytes_per_token / (self.host_to_device_gb_s * GB)

    def l3_fetch_s(self, pages: int, page_size: int) -> float:
        """Mooncake -> host; the load back to the GPU is charged on top."""
        return pages * page_size * self.kv_bytes_per_token / (self.l3_read_gb_s * GB)

    def decode_step_s(self, context_tokens: int) -> float:
        """One decode step of a batch whose sequences hold `context_tokens` tokens in all."""
        return (self.weight_bytes + context_tokens * self.kv_bytes_per_token) / (self.hbm_gb_s * GB)


#: A model with no cost at all: TTFT is pure queueing, for tests that want exact numbers.
FREE = CostModel(prefill_tokens_per_s=float("inf"), host_to_device_gb_s=float("inf"), l3_read_gb_s=float("inf"),
                 weight_bytes=0.0, hbm_gb_s=float("inf"))


#: (field, flag, help) for every figure: one table, so the sim-worker, the replay and the tuner
#: take the same flags.
COST_FLAGS = (
    ("kv_bytes_per_token", "--kv-bytes-per-token", "Cost model: KV cache bytes per token (Llama-3.1-8B bf16: 131072)."),
    ("prefill_tokens_per_s", "--prefill-tokens-per-s", "Cost model: prefill throughput of one GPU, tokens/s."),
    ("host_to_device_gb_s", "--host-to-device-gb-s", "Cost model: host RAM -> GPU load-back bandwidth, GB/s."),
    ("l3_read_gb_s", "--l3-read-gb-s", "Cost model: Mooncake pool -> host read bandwidth per GPU, GB/s."),
    ("weight_bytes", "--weight-bytes", "Cost model: weight bytes read per decode step."),
    ("hbm_gb_s", "--hbm-gb-s", "Cost model: effective GPU memory bandwidth in decode, GB/s."),
)


def add_cost_model_arguments(parser) -> None:
    defaults = CostModel()
    kinds = {"kv_bytes_per_token": int}
    for name, flag, text in COST_FLAGS:
        parser.add_argument(flag, type=kinds.get(name, float), default=getattr(defaults, name), dest=f"cost_{name}",
                            help=text)


def cost_model_from_args(args) -> CostModel:
    """Raises ValueError naming the figure that is out of range."""
    return CostModel(**{name: getattr(args, f"cost_{name}") for name, _, _ in COST_FLAGS})
