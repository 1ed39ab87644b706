// The translation between Mesos's messages and the contract's (see
// translate.hpp).

#include "translate.hpp"

#include <algorithm>

#include <google/protobuf/descriptor.h>

#include <stout/foreach.hpp>

namespace v1 = gpuisolator::v1;

using mesos::ContainerID;
using mesos::ResourceStatistics;
using mesos::slave::ContainerConfig;
using mesos::slave::ContainerLaunchInfo;
using mesos::slave::ContainerLimitation;
using mesos::slave::ContainerState;

using std::string;

namespace gpu_isolator {

namespace {

// A Mesos message made from the sidecar's answer, which must hold every
// field Mesos requires.
template <typename T>
Try<T> toMesos(const google::protobuf::Message& answer, const string& what)
{
  Try<T> message = rewire<T>(answer, false);
  if (message.isError()) {
    return Error(message.error());
  }
  if (!message->IsInitialized()) {
    return Error(
        "the sidecar's " + what + " is not a Mesos " +
        message->GetTypeName() + ": " +
        message->InitializationErrorString());
  }
  return message;
}

} // namespace {


Try<v1::RecoverRequest> recoverRequest(
    const std::vector<ContainerState>& states,
    const hashset<ContainerID>& orphans)
{
  v1::RecoverRequest request;
  foreach (const ContainerState& state, states) {
    Try<v1::ContainerState> contract = rewire<v1::ContainerState>(state, true);
    if (contract.isError()) {
      return Error(contract.error());
    }
    *request.add_states() = contract.get();
  }
  foreach (const ContainerID& orphan, orphans) {
    Try<v1::ContainerID> contract = rewire<v1::ContainerID>(orphan, true);
    if (contract.isError()) {
      return Error(contract.error());
    }
    *request.add_orphans() = contract.get();
  }
  return request;
}


Try<v1::PrepareRequest> prepareRequest(
    const ContainerID& containerId,
    const ContainerConfig& containerConfig)
{
  Try<v1::PrepareRequest> request =
    containerRequest<v1::PrepareRequest>(containerId);
  if (request.isError()) {
    return Error(request.error());
  }
  Try<v1::ContainerConfig> config =
    rewire<v1::ContainerConfig>(containerConfig, true);
  if (config.isError()) {
    return Error(config.error());
  }
  *request->mutable_container_config() = config.get();
  return request;
}


Try<v1::IsolateRequest> isolateRequest(
    const ContainerID& containerId,
    pid_t pid)
{
  Try<v1::IsolateRequest> request =
    containerRequest<v1::IsolateRequest>(containerId);
  if (request.isError()) {
    return Error(request.error());
  }
  request->set_pid(static_cast<uint64_t>(pid));
  return request;
}


Try<v1::UpdateRequest> updateRequest(
    const ContainerID& containerId,
    const mesos::Resources& resourceRequests)
{
  Try<v1::UpdateRequest> request =
    containerRequest<v1::UpdateRequest>(containerId);
  if (request.isError()) {
    return Error(request.error());
  }
  foreach (const mesos::Resource& resource, resourceRequests) {
    Try<v1::Resource> contract = rewire<v1::Resource>(resource, true);
    if (contract.isError()) {
      return Error(contract.error());
    }
    *request->add_resource_requests() = contract.get();
  }
  return request;
}


std::vector<string> updateReads(
    const google::protobuf::RepeatedPtrField<v1::Resource>& resources,
    const std::vector<string>& reads)
{
  std::vector<string> result;
  foreach (const v1::Resource& resource, resources) {
    bool read = false;
    foreach (const string& name, reads) {
      if (!name.empty() && name.back() == '*'
            ? resource.name().compare(0, name.size() - 1, name, 0,
                                      name.size() - 1) == 0
            : resource.name() == name) {
        read = true;
        break;
      }
    }
    if (!read) {
      continue;
    }
    v1::Resource kept = resource;
    kept.clear_role();
    result.push_back(kept.SerializeAsString());
  }
  std::sort(result.begin(), result.end());
  return result;
}


Try<Option<ContainerLaunchInfo>> launchInfoOf(
    const v1::PrepareResponse& response)
{
  if (!response.has_launch_info()) {
    return None();
  }
  Try<ContainerLaunchInfo> info =
    toMesos<ContainerLaunchInfo>(response.launch_info(), "launch info");
  if (info.isError()) {
    return Error(info.error());
  }
  return Option<ContainerLaunchInfo>(info.get());
}


Try<ResourceStatistics> statisticsOf(const v1::UsageResponse& response)
{
  // Mesos's ResourceStatistics has no field for per-GPU figures (they are
  // on the sidecar's own Usage and `gpu-isolator containers`); what it
  // has, it gets.
  return toMesos<ResourceStatistics>(response.statistics(), "statistics");
}


Try<ContainerLimitation> limitationOf(const v1::WatchResponse& response)
{
  if (!response.has_limitation()) {
    return Error("the sidecar's answer holds no limitation");
  }
  Try<ContainerLimitation> limitation =
    rewire<ContainerLimitation>(response.limitation(), false);
  if (limitation.isError()) {
    return Error(limitation.error());
  }
  // proto3 leaves a SCALAR type (its zero) off the wire; Mesos requires the
  // field.
  foreach (mesos::Resource& resource, *limitation->mutable_resources()) {
    if (!resource.has_type()) {
      resource.set_type(mesos::Value::SCALAR);
    }
  }
  if (!limitation->IsInitialized()) {
    return Error(
        "the sidecar's limitation is not a Mesos ContainerLimitation: " +
        limitation->InitializationErrorString());
  }
  return limitation;
}


ContainerLimitation isolateFailure(
    const string& container,
    const string& failure)
{
  ContainerLimitation limitation;
  limitation.set_message(
      "the launch of container " + container + " went on without waiting"
      " for its Isolate, which failed: " + failure);
  limitation.set_reason(mesos::TaskStatus::REASON_CONTAINER_LAUNCH_FAILED);
  return limitation;
}


const string& wireName(v1::MetadataKey key)
{
  const google::protobuf::EnumValueDescriptor* value =
    v1::MetadataKey_descriptor()->FindValueByNumber(key);
  // The keys are the generated enum's own values: a missing one or one
  // without a `(wire)` name is a build of a broken contract.
  CHECK(value != nullptr) << "no MetadataKey " << key << " in wire.proto";
  CHECK(value->options().HasExtension(v1::wire))
    << value->name() << " has no (wire) name in wire.proto";
  return value->options().GetExtension(v1::wire);
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

} // namespace gpu_isolator {
