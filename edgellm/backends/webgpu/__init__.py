"""The webgpu backend: the compiled graphs on any GPU reachable through WebGPU (wgpu-native:
Vulkan, Metal, Direct3D 12), with WGSL kernels generated from templates (kernels.py) through
storage descriptors (codegen.py). device.py finds adapters; backend.py executes programs."""
