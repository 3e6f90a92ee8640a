"""Triton kernels for CUDA tensors, installed as ``specdec.triton_kernels``: one file per operator
family, each tested against its torch reference in :mod:`specdec.kernels.reference` and chosen by
:mod:`specdec.kernels._dispatch` for CUDA inputs."""
