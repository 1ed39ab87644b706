// A Mesos isolator that forwards every hook to the GPU isolator sidecar over
// its gRPC socket. It keeps no policy: what to grant, record or release is
// the sidecar's (proto/gpuisolator/v1).

#ifndef GPU_ISOLATOR_MESOS_GPU_ISOLATOR_HPP
#define GPU_ISOLATOR_MESOS_GPU_ISOLATOR_HPP

#include <string>
#include <vector>

#include <mesos/module.hpp>
#include <mesos/slave/isolator.hpp>

#include <process/owned.hpp>

#include <stout/hashset.hpp>

#include "settings.hpp"

namespace gpu_isolator {

class GpuIsolatorProcess;


class GpuIsolator : public mesos::slave::Isolator
{
public:
  explicit GpuIsolator(const Settings& settings);
  ~GpuIsolator() override;

  // The sidecar decides for every kind of container; this module forwards
  // all of them.
  bool supportsNesting() override;
  bool supportsStandalone() override;

  process::Future<Nothing> recover(
      const std::vector<mesos::slave::ContainerState>& states,
      const hashset<mesos::ContainerID>& orphans) override;

  process::Future<Option<mesos::slave::ContainerLaunchInfo>> prepare(
      const mesos::ContainerID& containerId,
      const mesos::slave::ContainerConfig& containerConfig) override;

  process::Future<Nothing> isolate(
      const mesos::ContainerID& containerId,
      pid_t pid) override;

  process::Future<mesos::slave::ContainerLimitation> watch(
      const mesos::ContainerID& containerId) override;

  process::Future<Nothing> update(
      const mesos::ContainerID& containerId,
      const mesos::Resources& resourceRequests,
      const google::protobuf::Map<std::string, mesos::Value::Scalar>&
        resourceLimits) override;

  process::Future<mesos::ResourceStatistics> usage(
      const mesos::ContainerID& containerId) override;

  process::Future<mesos::ContainerStatus> status(
      const mesos::ContainerID& containerId) override;

  process::Future<Nothing> cleanup(
      const mesos::ContainerID& containerId) override;

private:
  process::Owned<GpuIsolatorProcess> process;
};

} // namespace gpu_isolator {

#endif // GPU_ISOLATOR_MESOS_GPU_ISOLATOR_HPP
