// The part of torch's C++ API the kernels use: tensors, the few factory ops they call, the
// intra-op thread pool and pybind11's tensor casters. <torch/extension.h> would bring in the
// whole C++ frontend (autograd, nn, optim, serialization), whose parsing costs several times
// what compiling a kernel does, on the first start of every fresh install.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <torch/csrc/utils/pybind.h>

namespace torch {
using namespace at;  // as <torch/types.h> does: torch::Tensor, torch::empty, torch::kFloat
}  // namespace torch
