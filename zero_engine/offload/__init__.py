"""Offload: where model states live (placement.py), host and NVMe swapping of optimizer states
(optimizer_swap.py), and the NVMe file store they use (nvme.py)."""
