// The completion queue's looper thread (see runtime.hpp).

#include "runtime.hpp"

namespace gpu_isolator {

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
    call->finish();
    delete call;
  }
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
