// The module's decisions about time (see retry.hpp).

#include "retry.hpp"

#include <cstdlib>
#include <sstream>

#include "translate.hpp"

using std::string;

namespace gpu_isolator {

Option<Duration> retryAfter(
    grpc::StatusCode code,
    const Option<int64_t>& pushbackMs,
    const std::chrono::system_clock::time_point& now,
    const std::chrono::system_clock::time_point& deadline)
{
  Option<Duration> wait = None();
  if (code == grpc::RESOURCE_EXHAUSTED && pushbackMs.isSome()) {
    wait = Milliseconds(pushbackMs.get());
  } else if (code == grpc::UNAVAILABLE) {
    wait = UNAVAILABLE_RETRY;
  }
  if (wait.isNone() ||
      now + std::chrono::nanoseconds(wait->ns()) >= deadline) {
    return None();
  }
  return wait;
}


Option<int64_t> parsePushback(const string& text)
{
  // Digits only: strtoll alone would take a sign or leading blanks.
  if (text.empty() || text.size() > 18 ||
      text.find_first_not_of("0123456789") != string::npos) {
    return None();
  }
  return static_cast<int64_t>(std::strtoll(text.c_str(), nullptr, 10));
}


int64_t deadlineMs(
    const std::chrono::system_clock::time_point& deadline,
    const std::chrono::system_clock::time_point& now,
    const std::chrono::steady_clock::time_point& steadyNow)
{
  const auto at = steadyNow.time_since_epoch() + (deadline - now);
  return std::chrono::duration_cast<std::chrono::milliseconds>(at).count();
}


WatchNext watchNext(bool ended, grpc::StatusCode code, bool limited)
{
  if (!ended) {
    return WatchNext::WATCH_LATER;
  }
  if (code == grpc::OK) {
    return limited ? WatchNext::LIMITED : WatchNext::WATCH_NOW;
  }
  if (code == grpc::NOT_FOUND) {
    return WatchNext::STOP;
  }
  return WatchNext::WATCH_LATER;
}


CleanupWait cleanupWait(bool failed, bool reachable, bool connectedDuring)
{
  if (!failed || reachable) {
    return CleanupWait::FULL;
  }
  return connectedDuring ? CleanupWait::BRIEF : CleanupWait::NONE;
}


string describe(
    const string& hook,
    grpc::StatusCode code,
    const string& message,
    const string& socket,
    const Duration& timeout,
    const Option<string>& channel)
{
  std::ostringstream out;
  out << "gpu-isolator " << hook << ": " << codeName(code) << ": ";
  if (code == grpc::DEADLINE_EXCEEDED ||
      (code == grpc::UNAVAILABLE && message.empty())) {
    out << "no answer from the sidecar at '" << socket << "' within "
        << timeout;
    if (channel.isSome()) {
      out << " (it is " << channel.get()
          << ": is 'gpu-isolator serve' running?)";
    }
    if (!message.empty() && message != "Deadline Exceeded") {
      out << ": " << message;
    }
  } else {
    // The sidecar's own words (isolator/errors.py's messages).
    out << message;
  }
  return out.str();
}

} // namespace gpu_isolator {
