// The completion queue's looper thread (see runtime.hpp).

#include "runtime.hpp"

#include <cstdlib>

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
  // Every cancelled call still comes back through Next() before it returns false.
  queue.Shutdown();
  looper.join();
}


void Runtime::loop()
{
  void* tag = nullptr;
  bool ok = false;
  while (queue.Next(&tag, &ok)) {
    // A unary call's Finish tag always comes back with ok == true; the status says how it ended.
    Call* call = static_cast<Call*>(tag);
    {
      std::lock_guard<std::mutex> lock(mutex);
      open.erase(call);
    }
    call->finish();  // Sets the promise: its callbacks run here or are deferred to their actor.
    delete call;
  }
}


Option<int64_t> pushbackOf(const std::multimap<grpc::string_ref, grpc::string_ref>& trailers)
{
  auto found = trailers.find("grpc-retry-pushback-ms");
  if (found == trailers.end()) {
    return None();
  }
  const std::string text(found->second.data(), found->second.size());
  char* end = nullptr;
  const long long value = std::strtoll(text.c_str(), &end, 10);
  if (text.empty() || end == nullptr || *end != '\0' || value < 0) {
    return None();  // gRFC A6: a malformed or negative pushback means "do not retry".
  }
  return static_cast<int64_t>(value);
}

} // namespace gpu_isolator {
