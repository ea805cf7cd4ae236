"""Slice discovery: declared (emulated) inventories; NVML comes with the GPU path."""
