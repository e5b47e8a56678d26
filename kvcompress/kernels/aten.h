// The parts of ATen and of torch's pybind11 glue the kernels use. <torch/extension.h> brings all of torch's
// C++ frontend besides and takes about three times the CPU to compile (38 s against 12 s a kernel here), a
// cost every fresh machine and every CI run pays once per kernel and build.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <torch/csrc/utils/pybind.h>
