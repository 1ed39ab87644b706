// The completion queue's looper thread (see runtime.hpp).

#include "runtime.hpp"

namespace gpu_isolator {

namespace {

// How long one wait for a change of the channel's state lasts: also how long
// the runtime's end waits for the last one.
const std::chrono::milliseconds STATE_WAIT(500);

} // namespace {


// Waits for the channel's state to change, on the runtime's queue, and
// counts each change into READY; waits again until the runtime stops.
struct Runtime::ConnectionCounter : Runtime::Call
{
  ConnectionCounter(
      Runtime* _runtime,
      const std::shared_ptr<grpc::Channel>& _channel)
    : runtime(_runtime), channel(_channel)
  {
    last = channel->GetState(false);
    if (last == GRPC_CHANNEL_READY) {
      runtime->connected++;
    }
  }

  void arm()
  {
    channel->NotifyOnStateChange(
        last,
        std::chrono::system_clock::now() + STATE_WAIT,
        &runtime->queue,
        static_cast<Call*>(this));
  }

  bool finish(bool) override
  {
    const grpc_connectivity_state now = channel->GetState(false);
    if (now == GRPC_CHANNEL_READY && last != GRPC_CHANNEL_READY) {
      runtime->connected++;
    }
    last = now;
    std::lock_guard<std::mutex> lock(runtime->mutex);
    if (runtime->stopping) {
      return true;
    }
    arm();
    return false;
  }

  Runtime* runtime;
  std::shared_ptr<grpc::Channel> channel;
  grpc_connectivity_state last;
};


Runtime::Runtime() : looper([this]() { loop(); }) {}


Runtime::~Runtime()
{
  {
    std::lock_guard<std::mutex> lock(mutex);
    stopping = true;
    for (Call* call : open) {
      call->context.TryCancel();
    }
  }
  // Every cancelled call still comes back through Next() before it returns
  // false.
  queue.Shutdown();
  looper.join();
}


void Runtime::loop()
{
  void* tag = nullptr;
  bool ok = false;
  while (queue.Next(&tag, &ok)) {
    // A unary call's Finish tag always comes back with ok == true; the status
    // says how it ended.
    Call* call = static_cast<Call*>(tag);
    {
      std::lock_guard<std::mutex> lock(mutex);
      open.erase(call);
    }
    // Sets the promise: its callbacks run here or are deferred to their
    // actor.
    if (call->finish(ok)) {
      delete call;
    }
  }
}


void Runtime::countConnections(const std::shared_ptr<grpc::Channel>& channel)
{
  ConnectionCounter* counter = new ConnectionCounter(this, channel);
  std::lock_guard<std::mutex> lock(mutex);
  if (stopping) {
    delete counter;
    return;
  }
  counter->arm();
}


Option<int64_t> pushbackOf(
    const std::multimap<grpc::string_ref, grpc::string_ref>& trailers)
{
  auto found = trailers.find(
      wireName(gpuisolator::v1::METADATA_KEY_RETRY_PUSHBACK));
  if (found == trailers.end()) {
    return None();
  }
  return parsePushback(
      std::string(found->second.data(), found->second.size()));
}

} // namespace gpu_isolator {
