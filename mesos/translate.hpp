// The translation between Mesos's messages and the contract's
// (proto/gpuisolator/v1): pure functions a unit test calls without an agent.
//
// Translation is by the wire: the contract's messages are subsets of Mesos's
// own with Mesos's field numbers (isolator.proto), so a Mesos message
// serialized and parsed as the contract's keeps exactly the fields the
// sidecar reads, and the sidecar's answer parses back into Mesos's message.
// No field is copied by hand, and no message is defined twice.

#ifndef GPU_ISOLATOR_MESOS_TRANSLATE_HPP
#define GPU_ISOLATOR_MESOS_TRANSLATE_HPP

#include <string>
#include <vector>

#include <grpcpp/support/status_code_enum.h>

#include <mesos/mesos.hpp>
#include <mesos/resources.hpp>
#include <mesos/slave/isolator.hpp>

#include <stout/hashset.hpp>
#include <stout/option.hpp>
#include <stout/try.hpp>

#include "gpuisolator/v1/isolator.pb.h"
#include "gpuisolator/v1/wire.pb.h"

namespace gpu_isolator {

// `from` as the message `To` that shares its field numbers; `discard`: keep
// only `To`'s fields.
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


// Mesos's hooks' arguments as the contract's requests.
Try<gpuisolator::v1::RecoverRequest> recoverRequest(
    const std::vector<mesos::slave::ContainerState>& states,
    const hashset<mesos::ContainerID>& orphans);

Try<gpuisolator::v1::PrepareRequest> prepareRequest(
    const mesos::ContainerID& containerId,
    const mesos::slave::ContainerConfig& containerConfig);

Try<gpuisolator::v1::IsolateRequest> isolateRequest(
    const mesos::ContainerID& containerId,
    pid_t pid);

Try<gpuisolator::v1::UpdateRequest> updateRequest(
    const mesos::ContainerID& containerId,
    const mesos::Resources& resourceRequests);

// The requests that carry the container alone (Watch, Usage, Status,
// Cleanup).
template <typename Request>
Try<Request> containerRequest(const mesos::ContainerID& containerId)
{
  Try<gpuisolator::v1::ContainerID> id =
    rewire<gpuisolator::v1::ContainerID>(containerId, true);
  if (id.isError()) {
    return Error(id.error());
  }
  Request request;
  *request.mutable_container_id() = id.get();
  return request;
}


// The sidecar's answers as Mesos's messages, each holding every field Mesos
// requires, or an error that says what is missing.
Try<Option<mesos::slave::ContainerLaunchInfo>> launchInfoOf(
    const gpuisolator::v1::PrepareResponse& response);

Try<mesos::ResourceStatistics> statisticsOf(
    const gpuisolator::v1::UsageResponse& response);

// The response must hold a limitation.
Try<mesos::slave::ContainerLimitation> limitationOf(
    const gpuisolator::v1::WatchResponse& response);

// What ends a container whose Isolate failed after its launch went on
// without it (PrepareResponse.isolate_unawaited): the failure, as a
// limitation its Watch reports, so that the agent destroys the container
// (TASK_FAILED, REASON_CONTAINER_LAUNCH_FAILED) as a failed isolate would.
mesos::slave::ContainerLimitation isolateFailure(
    const std::string& container,
    const std::string& failure);


// What an Update acts on in `resources` (the contract's): those whose name
// `reads` names (PrepareResponse.update_reads: names, and prefixes written
// "<prefix>*"), each as its name, type and value (its role aside), sorted,
// so that two such lists are equal exactly when the sidecar would read the
// same request from them. The module keeps the last one it sent per
// container and answers an Update equal to it itself (no round trip).
std::vector<std::string> updateReads(
    const google::protobuf::RepeatedPtrField<gpuisolator::v1::Resource>&
      resources,
    const std::vector<std::string>& reads);


// The exact string on the wire of a metadata key (wire.proto's `(wire)`).
const std::string& wireName(gpuisolator::v1::MetadataKey key);

// The name of a gRPC status code, as the sidecar's messages and logs use it.
const char* codeName(grpc::StatusCode code);

} // namespace gpu_isolator {

#endif // GPU_ISOLATOR_MESOS_TRANSLATE_HPP
