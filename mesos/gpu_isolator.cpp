// Each hook becomes one call of the sidecar's Isolator service
// (proto/gpuisolator/v1); this file only forwards: it builds the request
// (translate.hpp), retries within the hook's deadline (retry.hpp) and says
// what went wrong. It must not decide anything about GPUs: an answer is
// passed on as the sidecar gave it.

#include "gpu_isolator.hpp"

#include <algorithm>
#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <grpcpp/grpcpp.h>

#include <mesos/type_utils.hpp>

#include <process/after.hpp>
#include <process/defer.hpp>
#include <process/delay.hpp>
#include <process/dispatch.hpp>
#include <process/id.hpp>
#include <process/owned.hpp>
#include <process/process.hpp>

#include <stout/hashmap.hpp>
#include <stout/stringify.hpp>

#include "gpuisolator/v1/isolator.grpc.pb.h"
#include "retry.hpp"
#include "runtime.hpp"
#include "translate.hpp"

namespace v1 = gpuisolator::v1;

using mesos::ContainerID;
using mesos::ContainerStatus;
using mesos::ResourceStatistics;
using mesos::Resources;
using mesos::slave::ContainerConfig;
using mesos::slave::ContainerLaunchInfo;
using mesos::slave::ContainerLimitation;
using mesos::slave::ContainerState;

using process::defer;
using process::Failure;
using process::Future;
using process::Owned;
using process::Promise;

using std::string;
using std::vector;

namespace gpu_isolator {

namespace {

using Clock = std::chrono::system_clock;


// Milliseconds since `start` on the monotonic clock, for the hooks' debug
// lines.
double msSince(const std::chrono::steady_clock::time_point& start)
{
  return std::chrono::duration<double, std::milli>(
      std::chrono::steady_clock::now() - start).count();
}


// How long the Cleanup of a container whose Prepare failed with the sidecar
// unreachable waits for it (see `cleanup`).
const Duration UNREACHED_CLEANUP_TIMEOUT = Seconds(1);


Option<string> channelState(grpc_connectivity_state state)
{
  switch (state) {
    case GRPC_CHANNEL_READY: return None();
    case GRPC_CHANNEL_IDLE: return string("idle");
    case GRPC_CHANNEL_CONNECTING: return string("connecting");
    case GRPC_CHANNEL_TRANSIENT_FAILURE: return string("unreachable");
    case GRPC_CHANNEL_SHUTDOWN: return string("shut down");
  }
  return string("in an unknown state");
}


template <typename Request, typename Response>
using AsyncMethod =
  std::unique_ptr<grpc::ClientAsyncResponseReader<Response>> (
      v1::Isolator::Stub::*)(
          grpc::ClientContext*, const Request&, grpc::CompletionQueue*);

} // namespace {


class GpuIsolatorProcess : public process::Process<GpuIsolatorProcess>
{
public:
  explicit GpuIsolatorProcess(const Settings& _settings)
    : ProcessBase(process::ID::generate("gpu-isolator")),
      settings(_settings)
  {
    grpc::ChannelArguments arguments;
    // Reconnect soon after a sidecar restart: gRPC's default backoff grows
    // to 120 s.
    arguments.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
    arguments.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 100);
    arguments.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
    channel = grpc::CreateCustomChannel(
        settings.address(),
        grpc::InsecureChannelCredentials(),
        arguments);
    stub = v1::Isolator::NewStub(channel);
    runtime.countConnections(channel);
  }

  Future<Nothing> recover(
      const vector<ContainerState>& states,
      const hashset<ContainerID>& orphans)
  {
    Try<v1::RecoverRequest> request = recoverRequest(states, orphans);
    if (request.isError()) {
      return Failure("gpu-isolator Recover: " + request.error());
    }
    LOG(INFO) << "gpu-isolator: recovering " << states.size()
              << " containers and " << orphans.size()
              << " orphans through the sidecar at '" << settings.address()
              << "'";
    return forward(
        "Recover",
        "",
        &v1::Isolator::Stub::PrepareAsyncRecover,
        request.get(),
        settings.recover_timeout)
      .then([](const v1::RecoverResponse& response) -> Future<Nothing> {
        LOG(INFO) << "gpu-isolator: the sidecar recovered "
                  << response.recovered() << " containers and released "
                  << response.released();
        return Nothing();
      });
  }

  Future<Option<ContainerLaunchInfo>> prepare(
      const ContainerID& containerId,
      const ContainerConfig& containerConfig)
  {
    Try<v1::PrepareRequest> request =
      prepareRequest(containerId, containerConfig);
    if (request.isError()) {
      return Failure("gpu-isolator Prepare: " + request.error());
    }
    const v1::PrepareRequest message = request.get();
    isolating.insert(containerId);
    return inOrder<Option<ContainerLaunchInfo>>("Prepare", containerId, [=]() {
      // Whether the sidecar can have seen this Prepare, should it not succeed
      // (see `cleanup`): connected now, or connected while it is tried. Kept
      // from here until it succeeds, and read by the Cleanup itself: taken
      // when the Prepare failed instead (a callback of its future, one
      // dispatch later), it raced the agent's own continuation of the
      // failure, which can reach `cleanup` first on a loaded host (seen
      // once in CI: a Cleanup that waited its whole deadline for nothing).
      preparing[containerId] = PrepareTry{
        channel->GetState(false) == GRPC_CHANNEL_READY,
        runtime.connections()};
      return forward(
          "Prepare",
          stringify(containerId),
          &v1::Isolator::Stub::PrepareAsyncPrepare,
          message,
          settings.prepare_timeout)
        // Not deferred: `forward`'s future is set on this process (its reply
        // is taken there), and a `then` runs only on a ready one, so this
        // runs on this process too, without one more dispatch (issue 45).
        .then([=](const v1::PrepareResponse& response)
                  -> Future<Option<ContainerLaunchInfo>> {
          Try<Option<ContainerLaunchInfo>> info = launchInfoOf(response);
          if (info.isError()) {
            return Failure("gpu-isolator Prepare: " + info.error());
          }
          preparing.erase(containerId);  // It succeeded: see `cleanup`.
          remember(
              containerId,
              std::vector<string>(
                  response.update_reads().begin(),
                  response.update_reads().end()),
              message.container_config().resources());
          if (response.isolate_unawaited()) {
            unawaited.insert(containerId);
          }
          return info.get();
        });
    });
  }

  Future<Nothing> isolate(const ContainerID& containerId, pid_t pid)
  {
    Try<v1::IsolateRequest> request = isolateRequest(containerId, pid);
    if (request.isError()) {
      return Failure("gpu-isolator Isolate: " + request.error());
    }
    const v1::IsolateRequest message = request.get();
    // The sidecar's Prepare said whether the launch must wait for this call
    // (PrepareResponse.isolate_unawaited): not when the agent places the pid
    // and Isolate only checks that it did (docs/mesos-agent.md, "A launch
    // waits for Isolate only when").
    const bool awaited = !unawaited.contains(containerId);
    unawaited.erase(containerId);
    Future<Nothing> result = inOrder<Nothing>("Isolate", containerId, [=]() {
      return forward(
          "Isolate",
          stringify(containerId),
          &v1::Isolator::Stub::PrepareAsyncIsolate,
          message,
          settings.isolate_timeout)
        .then([]() { return Nothing(); });
    });
    // The container's Watch, held back until now (see `watch`), opens; an
    // Isolate the launch did not wait for that failed ends the container
    // through it instead, as a failed isolate ends a launch.
    result.onAny(defer(self(), [=](const Future<Nothing>& isolated) {
      const bool cleaning = !isolating.contains(containerId);
      isolating.erase(containerId);
      if (!awaited && !isolated.isReady() && !cleaning) {
        const ContainerLimitation limitation = isolateFailure(
            stringify(containerId),
            isolated.isFailed() ? isolated.failure() : string("discarded"));
        LOG(WARNING) << "gpu-isolator: " << limitation.message();
        if (watchers.contains(containerId)) {
          std::shared_ptr<Watcher> watcher = watchers.at(containerId);
          stopWatch(containerId);
          watcher->promise.set(limitation);
        } else {
          failedIsolates[containerId] = limitation;  // for its Watch
        }
        return;
      }
      if (watchers.contains(containerId) &&
          watchers.at(containerId)->held) {
        watchers.at(containerId)->held = false;
        armWatch(containerId, watchers.at(containerId));
      }
    }));
    if (!awaited) {
      VLOG(1) << "gpu-isolator Isolate of container " << containerId
              << ": answered at once, sent without the launch waiting";
      return Nothing();
    }
    return result;
  }

  Future<ContainerLimitation> watch(const ContainerID& containerId)
  {
    Try<v1::WatchRequest> request =
      containerRequest<v1::WatchRequest>(containerId);
    if (request.isError()) {
      return Failure("gpu-isolator Watch: " + request.error());
    }
    if (watchers.contains(containerId)) {
      stopWatch(containerId);
    }
    if (failedIsolates.contains(containerId)) {
      const ContainerLimitation limitation = failedIsolates.at(containerId);
      failedIsolates.erase(containerId);
      return limitation;
    }
    std::shared_ptr<Watcher> watcher(new Watcher());
    watcher->request = request.get();
    watcher->asked = std::chrono::steady_clock::now();
    watchers[containerId] = watcher;
    // The agent asks for the Watch of a container it is launching between
    // its Prepare and its Isolate. Opened then, the Watch's first check runs
    // in the sidecar just as the Isolate arrives and delays it (issue 45:
    // 3.2 ms); held until the Isolate ends, it loses nothing, because its
    // first check reports any limitation that came in between. A container
    // this module did not prepare (recovered) is watched at once.
    if (isolating.contains(containerId)) {
      watcher->held = true;
    } else {
      armWatch(containerId, watcher);
    }
    return watcher->promise.future();
  }

  Future<Nothing> update(
      const ContainerID& containerId,
      const Resources& resourceRequests)
  {
    Try<v1::UpdateRequest> request =
      updateRequest(containerId, resourceRequests);
    if (request.isError()) {
      return Failure("gpu-isolator Update: " + request.error());
    }
    const v1::UpdateRequest message = request.get();
    return inOrder<Nothing>("Update", containerId, [=]() -> Future<Nothing> {
      // What the sidecar acts on, as last sent: equal, the Update changes
      // nothing there and is answered here. Unknown (no Prepare seen since
      // the agent started, or the last Update failed): it is sent.
      std::vector<string> reads;
      if (sent.contains(containerId)) {
        reads = sent.at(containerId).reads;
        if (updateReads(message.resource_requests(), reads) ==
              sent.at(containerId).resources) {
          VLOG(1) << "gpu-isolator: Update of container " << containerId
                  << " changes nothing the sidecar acts on; not sent";
          return Nothing();
        }
        sent.erase(containerId);
      }
      return forward(
          "Update",
          stringify(containerId),
          &v1::Isolator::Stub::PrepareAsyncUpdate,
          message,
          settings.update_timeout)
        .then([=]() -> Nothing { // On this process: see `prepare`.
          remember(containerId, reads, message.resource_requests());
          return Nothing();
        });
    });
  }

  Future<ResourceStatistics> usage(const ContainerID& containerId)
  {
    Try<v1::UsageRequest> request =
      containerRequest<v1::UsageRequest>(containerId);
    if (request.isError()) {
      return Failure("gpu-isolator Usage: " + request.error());
    }
    return forward(
        "Usage",
        stringify(containerId),
        &v1::Isolator::Stub::PrepareAsyncUsage,
        request.get(),
        settings.usage_timeout)
      .then([](const v1::UsageResponse& response)
                -> Future<ResourceStatistics> {
        Try<ResourceStatistics> statistics = statisticsOf(response);
        if (statistics.isError()) {
          return Failure("gpu-isolator Usage: " + statistics.error());
        }
        return statistics.get();
      });
  }

  Future<ContainerStatus> status(const ContainerID& containerId)
  {
    // Answered here, without a call: the sidecar's answer (GPU UUIDs, state)
    // has no place in Mesos's ContainerStatus, and the agent asks on every
    // status update of every container. Waiting held each update
    // (TASK_RUNNING's by 17 ms at the median); a call sent without waiting
    // (until issue 45) still cost the sidecar a handler on the launch path,
    // beside the executor starting, for nothing but a log line on failure,
    // which the container's Watch already gives (NOT_FOUND, logged).
    return ContainerStatus();
  }

  Future<Nothing> cleanup(const ContainerID& containerId)
  {
    if (watchers.contains(containerId)) {
      stopWatch(containerId);
    }
    isolating.erase(containerId);
    unawaited.erase(containerId);
    failedIsolates.erase(containerId);
    Try<v1::CleanupRequest> request =
      containerRequest<v1::CleanupRequest>(containerId);
    if (request.isError()) {
      return Failure("gpu-isolator Cleanup: " + request.error());
    }
    const v1::CleanupRequest message = request.get();
    return inOrder<Nothing>("Cleanup", containerId, [=]() -> Future<Nothing> {
      sent.erase(containerId);  // after the hooks before it, as each runs
      // A container whose Prepare failed while the sidecar could not be
      // reached waited its whole prepare deadline for a restart already.
      // Waiting again, a cleanup deadline more, would only delay the failed
      // launch's end (issue 45: 25 s + 25 s).
      CleanupWait wait = CleanupWait::FULL;
      if (preparing.contains(containerId)) {
        const PrepareTry tried = preparing.at(containerId);
        preparing.erase(containerId);
        wait = cleanupWait(
            true,
            channel->GetState(false) == GRPC_CHANNEL_READY,
            tried.readyAtStart ||
              runtime.connections() != tried.connectionsAtStart);
      }
      if (wait == CleanupWait::FULL) {
        return forward(
            "Cleanup",
            stringify(containerId),
            &v1::Isolator::Stub::PrepareAsyncCleanup,
            message,
            settings.cleanup_timeout)
          .then([]() { return Nothing(); });
      }
      if (wait == CleanupWait::NONE) {
        // The channel was never connected while the Prepare was tried: no
        // byte of it left the agent, so the sidecar holds nothing of the
        // container, now or after a restart.
        LOG(INFO) << "gpu-isolator Cleanup of container " << containerId
                  << ": its Prepare never reached the sidecar (not connected"
                  << " while it was tried); nothing to clean up there";
        return Nothing();
      }
      // The sidecar was connected at some moment of the Prepare, which it
      // may have served. So Cleanup is tried briefly; a sidecar still
      // unreachable then cannot be holding anything that needs it: a Prepare
      // reaching it later expires unserved (its deadline travels with it),
      // and one it served before it went away is released by its reaper once
      // the container's cgroup is gone (docs/mesos-agent.md).
      return forward(
          "Cleanup",
          stringify(containerId),
          &v1::Isolator::Stub::PrepareAsyncCleanup,
          message,
          std::min(settings.cleanup_timeout, UNREACHED_CLEANUP_TIMEOUT))
        .then([]() { return Nothing(); })
        .repair(defer(self(), [=](const Future<Nothing>& failed)
                                  -> Future<Nothing> {
          if (channel->GetState(false) == GRPC_CHANNEL_READY) {
            return failed;  // The sidecar is there and answered: it stands.
          }
          LOG(WARNING) << "gpu-isolator Cleanup of container " << containerId
                       << ": the sidecar is still unreachable, as it was when"
                       << " the container's Prepare failed; not waiting for"
                       << " it (its reaper releases anything it may hold)";
          return Nothing();
        }));
    });
  }

private:
  // What the sidecar acts on in a container's resources (its Prepare's
  // answer) and those it was last sent (at Prepare, or in an Update it
  // answered OK), in updateReads's form.
  struct Sent
  {
    std::vector<string> reads;
    std::vector<string> resources;
  };

  void remember(
      const ContainerID& containerId,
      const std::vector<string>& reads,
      const google::protobuf::RepeatedPtrField<v1::Resource>& resources)
  {
    if (reads.empty()) {
      return;  // The sidecar named nothing: every Update is sent.
    }
    Sent last;
    last.reads = reads;
    last.resources = updateReads(resources, reads);
    sent[containerId] = last;
  }

  struct Watcher
  {
    v1::WatchRequest request;
    Promise<ContainerLimitation> promise;
    Future<Reply<v1::WatchResponse>> call;
    bool stopped = false;
    bool held = false;  // not opened until the container's Isolate ends
    std::chrono::steady_clock::time_point asked; // when the agent called
    bool opened = false; // the call was sent at least once
  };

  // A container's hooks in flight: `last` is ready once the latest of them
  // ended (however it ended); `pending` counts them, so that the entry goes
  // once the last one ended.
  struct Hooks
  {
    Future<Nothing> last = Nothing();
    size_t pending = 0;
  };

  // One container's hooks run one after the other, in the order the agent
  // called them; those of different containers run at once. A hook runs
  // when the previous one ended, however it ended; with none in flight (the
  // launch path: Prepare, then Isolate once Prepare answered) it starts at
  // once, on this process, within the agent's call. libprocess's Sequence
  // did the ordering before (issue 45): it spawned a process per container
  // and hook, took two more dispatches before the call was sent, and
  // blocked a worker thread in its destructor until that process ended.
  // Each hook logs (VLOG(1), e.g. GLOG_vmodule=gpu_isolator=1) how long the
  // agent waited for it, from its call to its end, the wait behind earlier
  // hooks and retries included: the module's own view of each hook (the
  // agent bench reads these lines).
  template <typename T>
  Future<T> inOrder(
      const string& name,
      const ContainerID& containerId,
      const std::function<Future<T>()>& hook)
  {
    const std::chrono::steady_clock::time_point called =
      std::chrono::steady_clock::now();
    if (!ordered.contains(containerId)) {
      ordered.put(containerId, Owned<Hooks>(new Hooks()));
    }
    Owned<Hooks> hooks = ordered.at(containerId);
    hooks->pending++;

    Future<T> result;
    if (hooks->last.isPending()) {
      std::shared_ptr<Promise<T>> promise(new Promise<T>());
      hooks->last.onAny(defer(self(), [=](const Future<Nothing>&) {
        if (promise->future().hasDiscard()) {
          promise->discard(); // The agent gave up on it before it started.
        } else {
          promise->associate(hook());
        }
      }));
      result = promise->future();
    } else {
      result = hook();
    }

    // When the hook ended, taken where it ends (the log line comes one
    // dispatch later, on this process, which owns `ordered`), before
    // anything the agent chained on it: a future runs its onReady (onFailed,
    // onDiscarded) callbacks before its onAny ones, and the agent's own
    // continuation is one of those, run inline (for a Prepare, the rest of
    // its prepare chain). Taken in an onAny, 0.6-0.9 ms of the agent's work
    // after each Prepare was counted as the module's wait (issue 45).
    std::shared_ptr<Promise<Nothing>> ended(new Promise<Nothing>());
    std::shared_ptr<std::chrono::steady_clock::time_point> endedAt(
        new std::chrono::steady_clock::time_point(called));
    const std::function<void()> end = [ended, endedAt]() {
      if (ended->future().isPending()) {
        *endedAt = std::chrono::steady_clock::now();
        ended->set(Nothing());
      }
    };
    result.onReady([end](const T&) { end(); })
      .onFailed([end](const string&) { end(); })
      .onDiscarded([end]() { end(); });
    hooks->last = ended->future();

    result.onAny(defer(self(), [=](const Future<T>& done) {
      VLOG(1) << "gpu-isolator " << name << " of container " << containerId
              << ": " << (done.isReady() ? "done" : "failed") << " after "
              << std::chrono::duration<double, std::milli>(
                     *endedAt - called).count()
              << " ms";
      if (ordered.contains(containerId) &&
          ordered.at(containerId) == hooks && --hooks->pending == 0) {
        ordered.erase(containerId);
      }
    }));
    return result;
  }

  // One call of `method`, tried again within `timeout` while the sidecar asks
  // to (load shedding's `grpc-retry-pushback-ms`) or cannot take it
  // (UNAVAILABLE); anything else is the answer. The future it returns becomes
  // ready on this process (each reply is taken there).
  template <typename Request, typename Response>
  Future<Response> forward(
      const string& hook,
      const string& container,
      AsyncMethod<Request, Response> method,
      const Request& request,
      const Duration& timeout)
  {
    const Clock::time_point deadline =
      Clock::now() + std::chrono::nanoseconds(timeout.ns());
    return attempt(hook, container, method, request, timeout, deadline);
  }

  template <typename Request, typename Response>
  Future<Response> attempt(
      const string& hook,
      const string& container,
      AsyncMethod<Request, Response> method,
      const Request& request,
      const Duration& timeout,
      const Clock::time_point& deadline)
  {
    v1::Isolator::Stub* client = stub.get();
    Start<Response> start = [client, method, request](
        grpc::ClientContext* context, grpc::CompletionQueue* queue) {
      return (client->*method)(context, request, queue);
    };

    return runtime.call<Response>(start, deadline)
      .then(defer(self(), [=](const Reply<Response>& reply)
                              -> Future<Response> {
        if (reply.status.ok()) {
          return reply.response;
        }
        const grpc::StatusCode code = reply.status.error_code();
        const Option<Duration> wait =
          retryAfter(code, reply.pushback_ms, Clock::now(), deadline);
        const string of = container.empty() ? "" : " of container ";
        if (wait.isSome()) {
          VLOG(1) << "gpu-isolator " << hook << of << container << ": "
                  << codeName(code) << ", trying again in " << wait.get();
          return process::after(wait.get())
            .then(defer(self(), [=]() {
              return attempt(
                  hook, container, method, request, timeout, deadline);
            }));
        }
        const string message = describe(
            hook,
            code,
            reply.status.error_message(),
            settings.address(),
            timeout,
            channelState(channel->GetState(false)));
        LOG(WARNING) << message
                     << (container.empty()
                           ? "" : " (container " + container + ")");
        return Failure(message);
      }));
  }

  void armWatch(
      const ContainerID& containerId,
      const std::shared_ptr<Watcher>& watcher)
  {
    if (watcher->stopped) {
      return;
    }
    if (!watcher->opened) {
      watcher->opened = true;
      VLOG(1) << "gpu-isolator Watch of container " << containerId
              << ": opened after " << msSince(watcher->asked) << " ms";
    }
    v1::Isolator::Stub* client = stub.get();
    const v1::WatchRequest request = watcher->request;
    Start<v1::WatchResponse> start = [client, request](
        grpc::ClientContext* context, grpc::CompletionQueue* queue) {
      return client->PrepareAsyncWatch(context, request, queue);
    };
    // No deadline: the call ends when the sidecar reports a limitation, or
    // when it cannot go on (the sidecar stopped, the container is gone);
    // there is no polling period.
    watcher->call = runtime.call<v1::WatchResponse>(start, None());
    watcher->call.onAny(defer(
        self(),
        [=](const Future<Reply<v1::WatchResponse>>& call) {
          watched(containerId, watcher, call);
        }));
  }

  void watched(
      const ContainerID& containerId,
      const std::shared_ptr<Watcher>& watcher,
      const Future<Reply<v1::WatchResponse>>& call)
  {
    if (watcher->stopped) {
      return;
    }
    const bool ended = call.isReady();
    const grpc::StatusCode code =
      ended ? call->status.error_code() : grpc::UNKNOWN;
    const bool limited = ended && call->response.has_limitation();
    const string where =
      "gpu-isolator Watch of container " + stringify(containerId) + ": ";

    switch (watchNext(ended, code, limited)) {
      case WatchNext::WATCH_NOW: {
        armWatch(containerId, watcher);
        return;
      }
      case WatchNext::LIMITED: {
        Try<ContainerLimitation> limitation = limitationOf(call->response);
        if (limitation.isError()) {
          LOG(ERROR) << where << limitation.error();
          watchers.erase(containerId);
          watcher->promise.fail("gpu-isolator Watch: " + limitation.error());
          return;
        }
        LOG(INFO) << "gpu-isolator: container " << containerId
                  << " met a limitation: " << limitation->message();
        watchers.erase(containerId);
        watcher->promise.set(limitation.get());
        return;
      }
      case WatchNext::STOP: {
        // The sidecar holds nothing for it: there is nothing it could report.
        // The container is left running (a failed watch would make the agent
        // destroy it).
        LOG(WARNING) << where << "NOT_FOUND: " << call->status.error_message()
                     << "; not watched";
        return;
      }
      case WatchNext::WATCH_LATER: {
        // The sidecar stopped or restarted under the call, or refused it for
        // now: a failed watch would make the agent destroy a healthy
        // container, so watch again once it is back.
        const string why = !ended
          ? (call.isFailed() ? call.failure() : string("discarded"))
          : string(codeName(code)) + ": " + call->status.error_message();
        LOG(WARNING) << where << why << "; watching again in "
                     << settings.watch_retry_interval;
        process::delay(
            settings.watch_retry_interval,
            self(),
            &GpuIsolatorProcess::armWatch,
            containerId,
            watcher);
        return;
      }
    }
  }

  void stopWatch(const ContainerID& containerId)
  {
    std::shared_ptr<Watcher> watcher = watchers.at(containerId);
    watchers.erase(containerId);
    watcher->stopped = true;
    watcher->call.discard(); // Cancels the open call; its promise stays.
  }

  const Settings settings;
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<v1::Isolator::Stub> stub;
  Runtime runtime;
  hashmap<ContainerID, Owned<Hooks>> ordered;
  hashmap<ContainerID, std::shared_ptr<Watcher>> watchers;
  hashmap<ContainerID, Sent> sent;
  // Containers prepared here whose Isolate has not ended: their Watch waits.
  hashset<ContainerID> isolating;
  // Containers whose Prepare's answer said the launch need not wait for
  // their Isolate, until it is called.
  hashset<ContainerID> unawaited;
  // The limitation of a container whose unawaited Isolate failed before the
  // agent asked for its Watch (the agent asks before it isolates; kept in
  // case it ever does not).
  hashmap<ContainerID, ContainerLimitation> failedIsolates;
  // A container's Prepare, from when it is sent until it succeeds (a
  // Prepare that failed stays until the container's Cleanup): whether the
  // channel was connected when it was sent, and its count of connections
  // then (Runtime::connections).
  struct PrepareTry
  {
    bool readyAtStart;
    uint64_t connectionsAtStart;
  };
  hashmap<ContainerID, PrepareTry> preparing;
};


GpuIsolator::GpuIsolator(const Settings& settings)
  : process(new GpuIsolatorProcess(settings))
{
  process::spawn(process.get());
}


GpuIsolator::~GpuIsolator()
{
  process::terminate(process.get());
  process::wait(process.get());
}


bool GpuIsolator::supportsNesting()
{
  return true;
}


bool GpuIsolator::supportsStandalone()
{
  return true;
}


Future<Nothing> GpuIsolator::recover(
    const vector<ContainerState>& states,
    const hashset<ContainerID>& orphans)
{
  return process::dispatch(
      process.get(), &GpuIsolatorProcess::recover, states, orphans);
}


Future<Option<ContainerLaunchInfo>> GpuIsolator::prepare(
    const ContainerID& containerId,
    const ContainerConfig& containerConfig)
{
  return process::dispatch(
      process.get(),
      &GpuIsolatorProcess::prepare,
      containerId,
      containerConfig);
}


Future<Nothing> GpuIsolator::isolate(const ContainerID& containerId, pid_t pid)
{
  return process::dispatch(
      process.get(), &GpuIsolatorProcess::isolate, containerId, pid);
}


Future<ContainerLimitation> GpuIsolator::watch(const ContainerID& containerId)
{
  return process::dispatch(
      process.get(), &GpuIsolatorProcess::watch, containerId);
}


Future<Nothing> GpuIsolator::update(
    const ContainerID& containerId,
    const Resources& resourceRequests,
    const google::protobuf::Map<string, mesos::Value::Scalar>&)
{
  // GPUs have no limits apart from their count: the requests are the
  // contract's UpdateRequest.
  return process::dispatch(
      process.get(),
      &GpuIsolatorProcess::update,
      containerId,
      resourceRequests);
}


Future<ResourceStatistics> GpuIsolator::usage(const ContainerID& containerId)
{
  return process::dispatch(
      process.get(), &GpuIsolatorProcess::usage, containerId);
}


Future<ContainerStatus> GpuIsolator::status(const ContainerID& containerId)
{
  return process::dispatch(
      process.get(), &GpuIsolatorProcess::status, containerId);
}


Future<Nothing> GpuIsolator::cleanup(const ContainerID& containerId)
{
  return process::dispatch(
      process.get(), &GpuIsolatorProcess::cleanup, containerId);
}

} // namespace gpu_isolator {
