"""Stored-bytes decode floors of the Flash-shaped presets, bf16 against the released format (CPU: bytes only)."""
from dsv4.bench.latency import mean_decode_floor
from dsv4.models.config import parse_config_dict
from dsv4.models.presets import preset_config
from dsv4.quant.released import V4_RELEASE, V41_RELEASE
for preset, q in (("v4-flash-4l", V4_RELEASE), ("v41-flash-8l", V41_RELEASE)):
    cfg = parse_config_dict(preset_config(preset))
    for b in (1, 32):
        bf = mean_decode_floor(cfg, b, 512, 32, "bfloat16")
        rq = mean_decode_floor(cfg, b, 512, 32, "bfloat16", quant=q)
        print(preset, b, f"bf16 {bf.total/1e9:.3f} GB released {rq.total/1e9:.3f} GB ratio {rq.total/bf.total:.3f}",
              f"w {bf.weight_bytes/1e9:.3f}/{rq.weight_bytes/1e9:.3f} e {bf.expert_bytes/1e9:.3f}/{rq.expert_bytes/1e9:.3f} kv {bf.kv_bytes/1e9:.4f}/{rq.kv_bytes/1e9:.4f}")
