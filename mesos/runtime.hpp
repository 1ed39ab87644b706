// The module's asynchronous gRPC client: one completion queue, one thread
// that waits on it, and a libprocess Future per call. It decides nothing:
// retries and messages are the isolator's.
//
// Why not libprocess's own `process::grpc::client::Runtime`
// (process/grpc.hpp, present in 1.11 and 1.12 alike): its `call` keeps the
// `grpc::ClientContext` to itself and returns only the response or the
// status, so the server's trailing metadata never reaches the caller. The
// sidecar's one signal that a refusal may be retried,
// `grpc-retry-pushback-ms` (gRFC A6; wire.proto's
// METADATA_KEY_RETRY_PUSHBACK), is trailing metadata; without it a
// RESOURCE_EXHAUSTED "sidecar busy, retry in 20 ms" and a final "no free
// GPU" are the same bytes. This runtime is that one's shape (a looper thread
// draining a CompletionQueue, a Promise per call, discard cancels the call)
// plus the trailers.

#ifndef GPU_ISOLATOR_MESOS_RUNTIME_HPP
#define GPU_ISOLATOR_MESOS_RUNTIME_HPP

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>

#include <grpcpp/grpcpp.h>

#include <process/future.hpp>

#include <stout/option.hpp>
#include <stout/stringify.hpp>

#include "retry.hpp"
#include "translate.hpp"

namespace gpu_isolator {

// What a finished call brought back: the status, the response when OK, and
// the server's retry pushback in milliseconds when it sent one.
template <typename Response>
struct Reply
{
  grpc::Status status;
  Response response;
  Option<int64_t> pushback_ms;
};


// How a unary call is issued on a context and a queue: the generated stub's
// PrepareAsync<Method>.
template <typename Response>
using Start =
  std::function<std::unique_ptr<grpc::ClientAsyncResponseReader<Response>>(
      grpc::ClientContext*, grpc::CompletionQueue*)>;


class Runtime
{
public:
  Runtime();

  // Cancels every call still open, drains the queue and joins the thread.
  ~Runtime();

  Runtime(const Runtime&) = delete;
  Runtime& operator=(const Runtime&) = delete;

  // Starts a unary call. `deadline`: None waits for ever (Watch). The call
  // waits for the channel to connect (a sidecar that is restarting) instead
  // of failing at once. The future fails only once the runtime is shutting
  // down; discarding it cancels the call.
  template <typename Response>
  process::Future<Reply<Response>> call(
      const Start<Response>& start,
      const Option<std::chrono::system_clock::time_point>& deadline);

  // Starts counting `channel`'s connections (once, before any call): how
  // many times it became READY. A call can reach the server only over a
  // connection, so a count unchanged over a call that failed, with the
  // channel not READY at its start nor at its end, says that the server
  // never saw it (gpu_isolator.cpp's Cleanup after an unreached Prepare).
  void countConnections(const std::shared_ptr<grpc::Channel>& channel);

  // The count so far (0 before countConnections).
  uint64_t connections() const { return connected.load(); }

private:
  struct Call
  {
    virtual ~Call() {}
    // Called on the looper thread when the call's tag comes back; true when
    // the call is over (it is then deleted), false when it went on.
    virtual bool finish(bool ok) = 0;
    grpc::ClientContext context;
  };

  template <typename Response>
  struct UnaryCall;

  struct ConnectionCounter;

  void loop();

  grpc::CompletionQueue queue;
  std::mutex mutex;
  std::set<Call*> open; // Guarded by `mutex`: the calls to cancel at shutdown.
  bool stopping = false; // Guarded by `mutex`.
  std::atomic<uint64_t> connected{0};
  std::thread looper;
};


// The value of `grpc-retry-pushback-ms` among the trailers, if any parses
// as a non-negative number.
Option<int64_t> pushbackOf(
    const std::multimap<grpc::string_ref, grpc::string_ref>& trailers);


template <typename Response>
struct Runtime::UnaryCall : Runtime::Call
{
  bool finish(bool) override
  {
    Reply<Response> reply;
    reply.status = status;
    if (status.ok()) {
      reply.response = std::move(response);
    } else {
      reply.pushback_ms = pushbackOf(context.GetServerTrailingMetadata());
    }
    if (promise.future().hasDiscard()) {
      promise.discard();
    } else {
      promise.set(std::move(reply));
    }
    return true;
  }

  Response response;
  grpc::Status status;
  std::unique_ptr<grpc::ClientAsyncResponseReader<Response>> reader;
  process::Promise<Reply<Response>> promise;
};


template <typename Response>
process::Future<Reply<Response>> Runtime::call(
    const Start<Response>& start,
    const Option<std::chrono::system_clock::time_point>& deadline)
{
  UnaryCall<Response>* call = new UnaryCall<Response>();
  call->context.set_wait_for_ready(true);
  if (deadline.isSome()) {
    call->context.set_deadline(deadline.get());
    // gRPC sends the deadline relative (grpc-timeout), so a sidecar that was
    // stopped (SIGSTOP, a stalled disk) counts it from when it reads the call
    // and would still run a call whose caller gave up. The deadline itself
    // goes beside it (wire.proto's METADATA_KEY_DEADLINE): the sidecar keeps
    // the earlier of the two and answers a call found past it
    // DEADLINE_EXCEEDED unserved (docs/operations.md, "Stale hooks").
    call->context.AddMetadata(
        wireName(gpuisolator::v1::METADATA_KEY_DEADLINE),
        stringify(deadlineMs(
            deadline.get(),
            std::chrono::system_clock::now(),
            std::chrono::steady_clock::now())));
  }
  process::Future<Reply<Response>> future = call->promise.future();

  {
    std::lock_guard<std::mutex> lock(mutex);
    if (stopping) {
      delete call;
      return process::Failure("the module is shutting down");
    }
    open.insert(call);
  }

  // The context outlives the future's discard callback: a call leaves `open`
  // (and is deleted) only on the looper thread, after its tag came back,
  // under the same mutex.
  grpc::ClientContext* context = &call->context;
  Runtime* self = this;
  future.onDiscard([self, call, context]() {
    std::lock_guard<std::mutex> lock(self->mutex);
    if (self->open.count(call) > 0) {
      context->TryCancel();
    }
  });

  call->reader = start(&call->context, &queue);
  call->reader->StartCall();
  call->reader->Finish(
      &call->response, &call->status, static_cast<Call*>(call));
  return future;
}

} // namespace gpu_isolator {

#endif // GPU_ISOLATOR_MESOS_RUNTIME_HPP
