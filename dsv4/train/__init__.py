"""Training and evaluation of the demo model (issue 25): `dsv4 train-demo` trains a small DeepSeek-V4.1-architecture
model on the Python standard library with the engine's own modules (`demo`, `model`, `corpus`, `bpe`, `plot`);
`dsv4 eval` measures any checkpoint on any runtime path (`evaluate`)."""
