// The FFI handler symbols the nanobind module exports as capsules.
#pragma once

#include "xla/ffi/api/ffi.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(DmattnForwardCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(DmattnBackwardCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(DmattnSumListedKeysCpu);

#if defined(DMATTN_WITH_CUDA)
XLA_FFI_DECLARE_HANDLER_SYMBOL(DmattnForwardCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(DmattnBackwardCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(DmattnMaskMapCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(DmattnTopkLeaveCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(DmattnRangeMaskCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(DmattnSumListedKeysCuda);
#endif
