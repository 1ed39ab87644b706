// The module's decisions about time: when a refused call is sent again,
// what deadline a call carries, what a watch does next and what an operator
// reads when a hook fails. Pure functions a unit test calls without an
// agent; the sidecar's answers themselves are passed on as it gave them.

#ifndef GPU_ISOLATOR_MESOS_RETRY_HPP
#define GPU_ISOLATOR_MESOS_RETRY_HPP

#include <chrono>
#include <cstdint>
#include <string>

#include <grpcpp/support/status_code_enum.h>

#include <stout/duration.hpp>
#include <stout/option.hpp>

namespace gpu_isolator {

// A pause before trying again a call that the sidecar could not take
// (UNAVAILABLE: it is stopping or restarting, or the connection broke
// under the call). The sidecar's hooks are idempotent
// (docs/mesos-agent.md), so a call that may or may not have run is sent
// again.
const Duration UNAVAILABLE_RETRY = Milliseconds(100);


// The pause before sending a refused call again, or None when the refusal
// is the answer: the sidecar asked for it (RESOURCE_EXHAUSTED with
// `grpc-retry-pushback-ms`, load shedding) or could not take the call
// (UNAVAILABLE), and the pause ends before `deadline`.
Option<Duration> retryAfter(
    grpc::StatusCode code,
    const Option<int64_t>& pushbackMs,
    const std::chrono::system_clock::time_point& now,
    const std::chrono::system_clock::time_point& deadline);


// The value of `grpc-retry-pushback-ms` when it is a non-negative number of
// milliseconds; None otherwise (gRFC A6: a malformed or negative pushback
// means "do not retry").
Option<int64_t> parsePushback(const std::string& text);


// The deadline as `gpu-isolator-deadline-ms` carries it: CLOCK_MONOTONIC
// milliseconds (libstdc++'s steady_clock on Linux, Python's
// time.monotonic()), `deadline - now` from `steadyNow`.
int64_t deadlineMs(
    const std::chrono::system_clock::time_point& deadline,
    const std::chrono::system_clock::time_point& now,
    const std::chrono::steady_clock::time_point& steadyNow);


// What a Watch does once its call ended.
enum class WatchNext
{
  LIMITED,     // The sidecar reported a limitation: the agent gets it.
  WATCH_NOW,   // Ended without one: wait again at once.
  WATCH_LATER, // The sidecar was away or refused: again after a pause.
  STOP,        // The sidecar holds nothing for the container.
};

// `ended`: the call came back (not failed or discarded in the module);
// then its status code and whether the answer holds a limitation. A failed
// watch would make the agent destroy a healthy container, so only a
// limitation ends it, and NOT_FOUND stops watching a container the
// sidecar cannot report on (the container is left running).
WatchNext watchNext(bool ended, grpc::StatusCode code, bool limited);


// How long the Cleanup of a container waits for the sidecar, from what the
// module knows of the container's Prepare.
enum class CleanupWait
{
  FULL,  // Its deadline (cleanup_timeout): the sidecar may hold the container.
  BRIEF, // Briefly: the Prepare failed with the sidecar unreachable, after it
         // was connected at some moment of the Prepare (which it may have
         // served before it went away: its reaper releases that).
  NONE,  // Not at all: the Prepare failed without the channel ever being
         // connected while it was tried, so the sidecar never saw it and
         // holds nothing of the container.
};

// `failed`: the container's Prepare did not succeed; `reachable`: the
// channel is connected now, at the Cleanup; `connectedDuring`: it was
// connected when the Prepare was sent or has connected since
// (Runtime::connections).
CleanupWait cleanupWait(bool failed, bool reachable, bool connectedDuring);


// What an operator reads in the agent's log and in the task's status
// message when `hook` failed with `code` and `message`. A call that got no
// answer says where it was sent, for how long and, when the channel is not
// connected, `channel` (e.g. "unreachable"; None when connected).
std::string describe(
    const std::string& hook,
    grpc::StatusCode code,
    const std::string& message,
    const std::string& socket,
    const Duration& timeout,
    const Option<std::string>& channel);

} // namespace gpu_isolator {

#endif // GPU_ISOLATOR_MESOS_RETRY_HPP
