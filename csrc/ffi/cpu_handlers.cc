// CPU FFI handlers: decode the call, run the C++ kernels on XLA's intra-op thread pool.
#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <memory>
#include <mutex>

#include "cpu/attention.h"
#include "ffi/decode.h"
#include "ffi/handlers.h"

namespace dmattn {
namespace ffi = xla::ffi;

namespace {

// Runs tasks on the caller and on up to num_threads - 1 pool workers. The caller waits only for
// tasks that were claimed, never for a worker to start, so a busy pool cannot deadlock it.
cpu::ParallelFor MakeParallelFor(ffi::ThreadPool& pool) {
  return [&pool](int64_t count, const std::function<void(int64_t)>& task) {
    struct State {
      std::atomic<int64_t> next{0};
      std::atomic<int64_t> done{0};
      std::mutex mu;
      std::condition_variable all_done;
    };
    auto state = std::make_shared<State>();
    const std::function<void(int64_t)>* task_ptr = &task;
    auto drain = [state, task_ptr, count] {
      for (int64_t i; (i = state->next.fetch_add(1)) < count;) {
        (*task_ptr)(i);
        if (state->done.fetch_add(1) + 1 == count) {
          std::lock_guard<std::mutex> lock(state->mu);
          state->all_done.notify_all();
        }
      }
    };
    const int64_t helpers = std::min<int64_t>(pool.num_threads(), count) - 1;
    for (int64_t w = 0; w < helpers; ++w) pool.Schedule(decltype(drain)(drain));
    drain();
    std::unique_lock<std::mutex> lock(state->mu);
    state->all_done.wait(lock, [&] { return state->done.load() == count; });
  };
}

ffi::Error CpuForward(ffi::ThreadPool pool, ffi::RemainingArgs args, ffi::RemainingRets rets,
                      AttentionAttrs attrs) {
  AttentionShape shape;
  ForwardArgs ptrs;
  if (auto e = DecodeForward(args, rets, attrs, &shape, &ptrs); e.failure()) return e;
  cpu::Forward(shape, ptrs, MakeParallelFor(pool));
  return ffi::Error::Success();
}

ffi::Error CpuBackward(ffi::ThreadPool pool, ffi::RemainingArgs args, ffi::RemainingRets rets,
                       AttentionAttrs attrs) {
  AttentionShape shape;
  BackwardArgs ptrs;
  if (auto e = DecodeBackward(args, rets, attrs, &shape, &ptrs); e.failure()) return e;
  cpu::Backward(shape, ptrs, MakeParallelFor(pool));
  return ffi::Error::Success();
}

ffi::Error CpuSumListedKeys(ffi::ThreadPool pool, ffi::AnyBuffer grad, ffi::AnyBuffer slots,
                            ffi::AnyBuffer spans, ffi::Result<ffi::AnyBuffer> out) {
  ListedKeysShape shape;
  ListedKeysArgs ptrs;
  if (auto e = DecodeListedKeys(grad, slots, spans, *out, &shape, &ptrs); e.failure()) return e;
  cpu::SumListedKeys(shape, ptrs, MakeParallelFor(pool));
  return ffi::Error::Success();
}

// Every CPU handler runs on XLA's thread pool; the attention ones decode their operands
// themselves.
auto OnThreadPool() { return ffi::Ffi::Bind().Ctx<ffi::ThreadPool>(); }
auto AttentionBinding() {
  return OnThreadPool().RemainingArgs().RemainingRets().Attrs<AttentionAttrs>();
}

}  // namespace
}  // namespace dmattn

XLA_FFI_DEFINE_HANDLER_SYMBOL(DmattnForwardCpu, dmattn::CpuForward, dmattn::AttentionBinding());

XLA_FFI_DEFINE_HANDLER_SYMBOL(DmattnBackwardCpu, dmattn::CpuBackward, dmattn::AttentionBinding());

XLA_FFI_DEFINE_HANDLER_SYMBOL(DmattnSumListedKeysCpu, dmattn::CpuSumListedKeys,
                              dmattn::OnThreadPool()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Ret<xla::ffi::AnyBuffer>());
