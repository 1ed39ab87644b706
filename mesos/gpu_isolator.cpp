// Each hook becomes one call of the sidecar's Isolator service (proto/gpuisolator/v1); this file
// only translates, retries within the hook's deadline and says what went wrong. It must not decide
// anything about GPUs: an answer is passed on as the sidecar gave it.
//
// Translation is by the wire: the contract's messages are subsets of Mesos's own with Mesos's
// field numbers (proto/gpuisolator/v1/isolator.proto), so a Mesos message serialized and parsed as
// the contract's keeps exactly the fields the sidecar reads, and the sidecar's answer parses back
// into Mesos's message. No field is copied by hand, and no message is defined twice.

#include "gpu_isolator.hpp"

#include <chrono>
#include <functional>
#include <memory>
#include <sstream>
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
#include <process/process.hpp>

#include <stout/foreach.hpp>
#include <stout/hashmap.hpp>
#include <stout/stringify.hpp>

#include "gpuisolator/v1/isolator.grpc.pb.h"
#include "runtime.hpp"

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
using process::Promise;

using std::string;
using std::vector;

namespace gpu_isolator {

namespace {

using Clock = std::chrono::system_clock;

// A pause before trying again a call that the sidecar could not take (UNAVAILABLE: it is stopping
// or restarting, or the connection broke under the call). The sidecar's hooks are idempotent
// (docs/mesos-agent.md), so a call that may or may not have run is sent again.
const Duration UNAVAILABLE_RETRY = Milliseconds(100);


// `from` as the message `To` that shares its field numbers; `discard`: keep only `To`'s fields.
template <typename To, typename From>
Try<To> rewire(const From& from, bool discard)
{
  To to;
  if (!to.ParsePartialFromString(from.SerializePartialAsString())) {
    return Error(
        "cannot read a " + from.GetTypeName() + " as " + to.GetTypeName());
  }
  if (discard) {
    to.DiscardUnknownFields();
  }
  return to;
}


// A Mesos message made from the sidecar's answer must hold every field Mesos requires.
template <typename T>
Try<T> toMesos(const google::protobuf::Message& answer)
{
  Try<T> message = rewire<T>(answer, false);
  if (message.isError()) {
    return Error(message.error());
  }
  return message;
}


v1::ContainerID contractId(const ContainerID& containerId)
{
  return rewire<v1::ContainerID>(containerId, true).get();
}


const char* codeName(grpc::StatusCode code)
{
  switch (code) {
    case grpc::OK: return "OK";
    case grpc::CANCELLED: return "CANCELLED";
    case grpc::UNKNOWN: return "UNKNOWN";
    case grpc::INVALID_ARGUMENT: return "INVALID_ARGUMENT";
    case grpc::DEADLINE_EXCEEDED: return "DEADLINE_EXCEEDED";
    case grpc::NOT_FOUND: return "NOT_FOUND";
    case grpc::ALREADY_EXISTS: return "ALREADY_EXISTS";
    case grpc::PERMISSION_DENIED: return "PERMISSION_DENIED";
    case grpc::UNAUTHENTICATED: return "UNAUTHENTICATED";
    case grpc::RESOURCE_EXHAUSTED: return "RESOURCE_EXHAUSTED";
    case grpc::FAILED_PRECONDITION: return "FAILED_PRECONDITION";
    case grpc::ABORTED: return "ABORTED";
    case grpc::OUT_OF_RANGE: return "OUT_OF_RANGE";
    case grpc::UNIMPLEMENTED: return "UNIMPLEMENTED";
    case grpc::INTERNAL: return "INTERNAL";
    case grpc::UNAVAILABLE: return "UNAVAILABLE";
    case grpc::DATA_LOSS: return "DATA_LOSS";
    default: return "UNKNOWN";
  }
}


const char* channelState(grpc_connectivity_state state)
{
  switch (state) {
    case GRPC_CHANNEL_IDLE: return "idle";
    case GRPC_CHANNEL_CONNECTING: return "connecting";
    case GRPC_CHANNEL_READY: return "connected";
    case GRPC_CHANNEL_TRANSIENT_FAILURE: return "unreachable";
    case GRPC_CHANNEL_SHUTDOWN: return "shut down";
  }
  return "in an unknown state";
}


template <typename Request, typename Response>
using AsyncMethod = std::unique_ptr<grpc::ClientAsyncResponseReader<Response>> (
    v1::Isolator::Stub::*)(grpc::ClientContext*, const Request&, grpc::CompletionQueue*);

} // namespace {


Try<Settings> Settings::parse(const mesos::Parameters& parameters)
{
  Settings settings;
  foreach (const mesos::Parameter& parameter, parameters.parameter()) {
    const string& key = parameter.key();
    const string& value = parameter.value();
    if (key == "socket") {
      if (value.empty()) {
        return Error("parameter 'socket' is empty");
      }
      settings.socket = value;
      continue;
    }
    Duration* target = nullptr;
    if (key == "recover_timeout") target = &settings.recover_timeout;
    else if (key == "prepare_timeout") target = &settings.prepare_timeout;
    else if (key == "isolate_timeout") target = &settings.isolate_timeout;
    else if (key == "update_timeout") target = &settings.update_timeout;
    else if (key == "cleanup_timeout") target = &settings.cleanup_timeout;
    else if (key == "usage_timeout") target = &settings.usage_timeout;
    else if (key == "status_timeout") target = &settings.status_timeout;
    else if (key == "watch_retry_interval") target = &settings.watch_retry_interval;
    if (target == nullptr) {
      return Error("unknown parameter '" + key + "'");
    }
    Try<Duration> duration = Duration::parse(value);
    if (duration.isError() || duration.get() <= Duration::zero()) {
      return Error(
          "parameter '" + key + "': '" + value + "' is not a positive duration"
          " (e.g. '30secs', '500ms')");
    }
    *target = duration.get();
  }
  return settings;
}


class GpuIsolatorProcess : public process::Process<GpuIsolatorProcess>
{
public:
  explicit GpuIsolatorProcess(const Settings& _settings)
    : ProcessBase(process::ID::generate("gpu-isolator")),
      settings(_settings)
  {
    grpc::ChannelArguments arguments;
    // Reconnect soon after a sidecar restart: gRPC's default backoff grows to 120 s.
    arguments.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
    arguments.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 100);
    arguments.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
    channel = grpc::CreateCustomChannel(
        "unix:" + settings.socket, grpc::InsecureChannelCredentials(), arguments);
    stub = v1::Isolator::NewStub(channel);
  }

  Future<Nothing> recover(
      const vector<ContainerState>& states,
      const hashset<ContainerID>& orphans)
  {
    v1::RecoverRequest request;
    foreach (const ContainerState& state, states) {
      *request.add_states() = rewire<v1::ContainerState>(state, true).get();
    }
    foreach (const ContainerID& orphan, orphans) {
      *request.add_orphans() = contractId(orphan);
    }
    LOG(INFO) << "gpu-isolator: recovering " << states.size() << " containers and "
              << orphans.size() << " orphans through the sidecar at '" << settings.socket << "'";
    return forward("Recover", "", &v1::Isolator::Stub::PrepareAsyncRecover, request,
                   settings.recover_timeout)
      .then([](const v1::RecoverResponse& response) -> Future<Nothing> {
        LOG(INFO) << "gpu-isolator: the sidecar recovered " << response.recovered()
                  << " containers and released " << response.released();
        return Nothing();
      });
  }

  Future<Option<ContainerLaunchInfo>> prepare(
      const ContainerID& containerId,
      const ContainerConfig& containerConfig)
  {
    v1::PrepareRequest request;
    *request.mutable_container_id() = contractId(containerId);
    Try<v1::ContainerConfig> config = rewire<v1::ContainerConfig>(containerConfig, true);
    if (config.isError()) {
      return Failure("gpu-isolator Prepare: " + config.error());
    }
    *request.mutable_container_config() = config.get();
    return inOrder<Option<ContainerLaunchInfo>>(containerId, [=]() {
      return forward("Prepare", stringify(containerId), &v1::Isolator::Stub::PrepareAsyncPrepare,
                     request, settings.prepare_timeout)
        .then([](const v1::PrepareResponse& response) -> Future<Option<ContainerLaunchInfo>> {
          if (!response.has_launch_info()) {
            return None();
          }
          Try<ContainerLaunchInfo> info = toMesos<ContainerLaunchInfo>(response.launch_info());
          if (info.isError() || !info->IsInitialized()) {
            return Failure(
                "gpu-isolator Prepare: the sidecar's launch info is not a Mesos ContainerLaunchInfo: " +
                (info.isError() ? info.error() : info->InitializationErrorString()));
          }
          return info.get();
        });
    });
  }

  Future<Nothing> isolate(const ContainerID& containerId, pid_t pid)
  {
    v1::IsolateRequest request;
    *request.mutable_container_id() = contractId(containerId);
    request.set_pid(static_cast<uint64_t>(pid));
    return inOrder<Nothing>(containerId, [=]() {
      return forward("Isolate", stringify(containerId), &v1::Isolator::Stub::PrepareAsyncIsolate,
                     request, settings.isolate_timeout)
        .then([]() { return Nothing(); });
    });
  }

  Future<ContainerLimitation> watch(const ContainerID& containerId)
  {
    if (watchers.contains(containerId)) {
      stopWatch(containerId);
    }
    std::shared_ptr<Watcher> watcher(new Watcher());
    watchers[containerId] = watcher;
    armWatch(containerId, watcher);
    return watcher->promise.future();
  }

  Future<Nothing> update(const ContainerID& containerId, const Resources& resourceRequests)
  {
    v1::UpdateRequest request;
    *request.mutable_container_id() = contractId(containerId);
    foreach (const mesos::Resource& resource, resourceRequests) {
      *request.add_resource_requests() = rewire<v1::Resource>(resource, true).get();
    }
    return inOrder<Nothing>(containerId, [=]() {
      return forward("Update", stringify(containerId), &v1::Isolator::Stub::PrepareAsyncUpdate,
                     request, settings.update_timeout)
        .then([]() { return Nothing(); });
    });
  }

  Future<ResourceStatistics> usage(const ContainerID& containerId)
  {
    v1::UsageRequest request;
    *request.mutable_container_id() = contractId(containerId);
    return forward("Usage", stringify(containerId), &v1::Isolator::Stub::PrepareAsyncUsage,
                   request, settings.usage_timeout)
      .then([](const v1::UsageResponse& response) -> Future<ResourceStatistics> {
        // Mesos's ResourceStatistics has no field for per-GPU figures (they are on the sidecar's
        // own Usage and `gpu-isolator containers`); what it has, it gets.
        Try<ResourceStatistics> statistics = toMesos<ResourceStatistics>(response.statistics());
        if (statistics.isError() || !statistics->IsInitialized()) {
          return Failure("gpu-isolator Usage: the sidecar's statistics lack a timestamp");
        }
        return statistics.get();
      });
  }

  Future<ContainerStatus> status(const ContainerID& containerId)
  {
    v1::StatusRequest request;
    *request.mutable_container_id() = contractId(containerId);
    // The sidecar's answer (GPU UUIDs, state) has no place in Mesos's ContainerStatus, so the agent
    // is answered at once and the call goes on without it: the agent asks on every status update of
    // the container, and waiting would hold each update (TASK_RUNNING's too) for a round trip, and
    // for up to status_timeout while the sidecar is away. The call still says whether the sidecar
    // knows the container: a failure is logged by `attempt`, as the containerizer would have.
    forward("Status", stringify(containerId), &v1::Isolator::Stub::PrepareAsyncStatus,
            request, settings.status_timeout);
    return ContainerStatus();
  }

  Future<Nothing> cleanup(const ContainerID& containerId)
  {
    if (watchers.contains(containerId)) {
      stopWatch(containerId);
    }
    v1::CleanupRequest request;
    *request.mutable_container_id() = contractId(containerId);
    return inOrder<Nothing>(containerId, [=]() {
      return forward("Cleanup", stringify(containerId), &v1::Isolator::Stub::PrepareAsyncCleanup,
                     request, settings.cleanup_timeout)
        .then([]() { return Nothing(); });
    });
  }

private:
  struct Watcher
  {
    Promise<ContainerLimitation> promise;
    Future<Reply<v1::WatchResponse>> call;
    bool stopped = false;
  };

  // One container's hooks run one after the other, in the order the agent called them; those of
  // different containers run at once. A hook runs when the previous one ended, however it ended.
  template <typename T>
  Future<T> inOrder(const ContainerID& containerId, const std::function<Future<T>()>& hook)
  {
    Future<Nothing> previous = tails.contains(containerId)
      ? tails.at(containerId) : Future<Nothing>(Nothing());
    std::shared_ptr<Promise<T>> promise(new Promise<T>());
    std::shared_ptr<Promise<Nothing>> finished(new Promise<Nothing>());
    tails[containerId] = finished->future();

    previous.onAny(defer(self(), [=](const Future<Nothing>&) {
      Future<T> result = hook();
      promise->associate(result);
      result.onAny([=](const Future<T>&) { finished->set(Nothing()); });
    }));

    finished->future().onAny(defer(self(), [=](const Future<Nothing>&) {
      if (tails.contains(containerId) && tails.at(containerId) == finished->future()) {
        tails.erase(containerId);
      }
    }));
    return promise->future();
  }

  // One call of `method`, tried again within `timeout` while the sidecar asks to (load shedding's
  // `grpc-retry-pushback-ms`) or cannot take it (UNAVAILABLE); anything else is the answer.
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
    std::function<std::unique_ptr<grpc::ClientAsyncResponseReader<Response>>(
        grpc::ClientContext*, grpc::CompletionQueue*)> start =
      [client, method, request](grpc::ClientContext* context, grpc::CompletionQueue* queue) {
        return (client->*method)(context, request, queue);
      };

    return runtime.call<Response>(start, deadline)
      .then(defer(self(), [=](const Reply<Response>& reply) -> Future<Response> {
        if (reply.status.ok()) {
          return reply.response;
        }
        const grpc::StatusCode code = reply.status.error_code();
        Option<Duration> wait = None();
        if (code == grpc::RESOURCE_EXHAUSTED && reply.pushback_ms.isSome()) {
          wait = Milliseconds(reply.pushback_ms.get());
        } else if (code == grpc::UNAVAILABLE) {
          wait = UNAVAILABLE_RETRY;
        }
        if (wait.isSome() &&
            Clock::now() + std::chrono::nanoseconds(wait->ns()) < deadline) {
          VLOG(1) << "gpu-isolator " << hook << (container.empty() ? "" : " of container ")
                  << container << ": " << codeName(code) << ", trying again in " << wait.get();
          return process::after(wait.get())
            .then(defer(self(), [=]() {
              return attempt(hook, container, method, request, timeout, deadline);
            }));
        }
        const string message = describe(hook, reply.status, timeout);
        LOG(WARNING) << message << (container.empty() ? "" : " (container " + container + ")");
        return Failure(message);
      }));
  }

  // What an operator reads in the agent's log and in the task's status message.
  string describe(const string& hook, const grpc::Status& status, const Duration& timeout)
  {
    std::ostringstream out;
    out << "gpu-isolator " << hook << ": " << codeName(status.error_code()) << ": ";
    if (status.error_code() == grpc::DEADLINE_EXCEEDED ||
        (status.error_code() == grpc::UNAVAILABLE && status.error_message().empty())) {
      const grpc_connectivity_state state = channel->GetState(false);
      out << "no answer from the sidecar at '" << settings.socket << "' within " << timeout;
      if (state != GRPC_CHANNEL_READY) {
        out << " (it is " << channelState(state) << ": is 'gpu-isolator serve' running?)";
      }
      if (!status.error_message().empty() && status.error_message() != "Deadline Exceeded") {
        out << ": " << status.error_message();
      }
    } else {
      out << status.error_message();  // The sidecar's own words (isolator/errors.py's messages).
    }
    return out.str();
  }

  void armWatch(const ContainerID& containerId, const std::shared_ptr<Watcher>& watcher)
  {
    if (watcher->stopped) {
      return;
    }
    v1::WatchRequest request;
    *request.mutable_container_id() = contractId(containerId);
    v1::Isolator::Stub* client = stub.get();
    std::function<std::unique_ptr<grpc::ClientAsyncResponseReader<v1::WatchResponse>>(
        grpc::ClientContext*, grpc::CompletionQueue*)> start =
      [client, request](grpc::ClientContext* context, grpc::CompletionQueue* queue) {
        return client->PrepareAsyncWatch(context, request, queue);
      };
    // No deadline: the call ends when the sidecar reports a limitation, or when it cannot go on
    // (the sidecar stopped, the container is gone); there is no polling period.
    watcher->call = runtime.call<v1::WatchResponse>(start, None());
    watcher->call.onAny(defer(self(), [=](const Future<Reply<v1::WatchResponse>>& call) {
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
    if (!call.isReady()) {
      LOG(WARNING) << "gpu-isolator Watch of container " << containerId << ": "
                   << (call.isFailed() ? call.failure() : "discarded") << "; watching again in "
                   << settings.watch_retry_interval;
      process::delay(settings.watch_retry_interval, self(), &GpuIsolatorProcess::armWatch,
                     containerId, watcher);
      return;
    }
    const Reply<v1::WatchResponse>& reply = call.get();
    if (reply.status.ok()) {
      if (!reply.response.has_limitation()) {
        armWatch(containerId, watcher);  // Ended without a limitation: wait again.
        return;
      }
      Try<ContainerLimitation> limitation = toMesos<ContainerLimitation>(reply.response.limitation());
      if (limitation.isError()) {
        LOG(ERROR) << "gpu-isolator Watch of container " << containerId << ": " << limitation.error();
        watcher->promise.fail("gpu-isolator Watch: " + limitation.error());
        return;
      }
      // proto3 leaves a SCALAR type (its zero) off the wire; Mesos requires the field.
      foreach (mesos::Resource& resource, *limitation->mutable_resources()) {
        if (!resource.has_type()) {
          resource.set_type(mesos::Value::SCALAR);
        }
      }
      LOG(INFO) << "gpu-isolator: container " << containerId << " met a limitation: "
                << limitation->message();
      watchers.erase(containerId);
      watcher->promise.set(limitation.get());
      return;
    }
    if (reply.status.error_code() == grpc::NOT_FOUND) {
      // The sidecar holds nothing for it: there is nothing it could report. The container is
      // left running (a failed watch would make the agent destroy it).
      LOG(WARNING) << "gpu-isolator Watch of container " << containerId << ": NOT_FOUND: "
                   << reply.status.error_message() << "; not watched";
      return;
    }
    // The sidecar stopped or restarted under the call, or refused it for now: a failed watch
    // would make the agent destroy a healthy container, so watch again once it is back.
    LOG(WARNING) << "gpu-isolator Watch of container " << containerId << ": "
                 << codeName(reply.status.error_code()) << ": " << reply.status.error_message()
                 << "; watching again in " << settings.watch_retry_interval;
    process::delay(settings.watch_retry_interval, self(), &GpuIsolatorProcess::armWatch,
                   containerId, watcher);
  }

  void stopWatch(const ContainerID& containerId)
  {
    std::shared_ptr<Watcher> watcher = watchers.at(containerId);
    watchers.erase(containerId);
    watcher->stopped = true;
    watcher->call.discard();  // Cancels the open call; its promise stays pending.
  }

  const Settings settings;
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<v1::Isolator::Stub> stub;
  Runtime runtime;
  hashmap<ContainerID, Future<Nothing>> tails;
  hashmap<ContainerID, std::shared_ptr<Watcher>> watchers;
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
  return process::dispatch(process.get(), &GpuIsolatorProcess::recover, states, orphans);
}


Future<Option<ContainerLaunchInfo>> GpuIsolator::prepare(
    const ContainerID& containerId,
    const ContainerConfig& containerConfig)
{
  return process::dispatch(
      process.get(), &GpuIsolatorProcess::prepare, containerId, containerConfig);
}


Future<Nothing> GpuIsolator::isolate(const ContainerID& containerId, pid_t pid)
{
  return process::dispatch(process.get(), &GpuIsolatorProcess::isolate, containerId, pid);
}


Future<ContainerLimitation> GpuIsolator::watch(const ContainerID& containerId)
{
  return process::dispatch(process.get(), &GpuIsolatorProcess::watch, containerId);
}


Future<Nothing> GpuIsolator::update(
    const ContainerID& containerId,
    const Resources& resourceRequests,
    const google::protobuf::Map<string, mesos::Value::Scalar>&)
{
  // GPUs have no limits apart from their count: the requests are the contract's UpdateRequest.
  return process::dispatch(
      process.get(), &GpuIsolatorProcess::update, containerId, resourceRequests);
}


Future<ResourceStatistics> GpuIsolator::usage(const ContainerID& containerId)
{
  return process::dispatch(process.get(), &GpuIsolatorProcess::usage, containerId);
}


Future<ContainerStatus> GpuIsolator::status(const ContainerID& containerId)
{
  return process::dispatch(process.get(), &GpuIsolatorProcess::status, containerId);
}


Future<Nothing> GpuIsolator::cleanup(const ContainerID& containerId)
{
  return process::dispatch(process.get(), &GpuIsolatorProcess::cleanup, containerId);
}

} // namespace gpu_isolator {
