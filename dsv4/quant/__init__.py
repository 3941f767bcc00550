"""Low-precision weights as the released checkpoints store them (FP8 block-scaled, MXFP4 experts): the formats,
the checkpoint's `quantization_config`, and the quantized layers that compute from the stored bytes."""
