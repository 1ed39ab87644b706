// A Mesos isolator that forwards every hook to the GPU isolator sidecar over its gRPC socket.
// It keeps no policy: what to grant, record or release is the sidecar's (proto/gpuisolator/v1).

#ifndef GPU_ISOLATOR_MESOS_GPU_ISOLATOR_HPP
#define GPU_ISOLATOR_MESOS_GPU_ISOLATOR_HPP

#include <string>
#include <vector>

#include <mesos/module.hpp>
#include <mesos/slave/isolator.hpp>

#include <process/owned.hpp>

#include <stout/duration.hpp>
#include <stout/hashset.hpp>
#include <stout/try.hpp>

namespace gpu_isolator {

// The module's parameters (modules.json), each with its default.
struct Settings
{
  // The sidecar's gRPC socket (`gpu-isolator serve --socket`).
  std::string socket = "/run/gpu-isolator/isolator.sock";

  // How long each hook may take, retries included, before it fails with a message. Recover is
  // longer: the agent waits for it once, at start, and exits if it fails.
  Duration recover_timeout = Seconds(60);
  Duration prepare_timeout = Seconds(30);
  Duration isolate_timeout = Seconds(30);
  Duration update_timeout = Seconds(30);
  Duration cleanup_timeout = Seconds(30);
  Duration usage_timeout = Seconds(5);
  Duration status_timeout = Seconds(5);

  // A Watch is one call that ends when a limitation happens; it is opened again at once when it
  // ends without one, and after this pause when the sidecar could not be reached.
  Duration watch_retry_interval = Milliseconds(500);

  static Try<Settings> parse(const mesos::Parameters& parameters);
};


class GpuIsolatorProcess;


class GpuIsolator : public mesos::slave::Isolator
{
public:
  explicit GpuIsolator(const Settings& settings);
  ~GpuIsolator() override;

  // The sidecar decides for every kind of container; this module forwards all of them.
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
      const google::protobuf::Map<std::string, mesos::Value::Scalar>& resourceLimits) override;

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
