// The module's parameters (modules.json): what each means, its default,
// and their parsing, which a unit test calls without an agent.

#ifndef GPU_ISOLATOR_MESOS_SETTINGS_HPP
#define GPU_ISOLATOR_MESOS_SETTINGS_HPP

#include <string>

#include <mesos/mesos.hpp>

#include <stout/duration.hpp>
#include <stout/try.hpp>

namespace gpu_isolator {

struct Settings
{
  // The sidecar's gRPC socket (`gpu-isolator serve --socket`).
  std::string socket = "/run/gpu-isolator/isolator.sock";

  // Which of the sidecar's two doors the module calls (parameter `route`):
  // "direct" (the default), the gRPC server's own socket `<socket>.d/grpc`,
  // in the sidecar's 0700 directory, which only root (the agent) can reach,
  // so the kernel has already admitted the caller and no gate copies the
  // bytes; or "gate", the public `socket`, through the sidecar's
  // SO_PEERCRED gate, for an agent that does not run as the sidecar's uid.
  bool direct = true;

  // How long each hook may take, retries included, before it fails with a
  // message. Recover is longer: the agent waits for it once, at start, and
  // exits if it fails.
  Duration recover_timeout = Seconds(60);
  Duration prepare_timeout = Seconds(30);
  Duration isolate_timeout = Seconds(30);
  Duration update_timeout = Seconds(30);
  Duration cleanup_timeout = Seconds(30);
  Duration usage_timeout = Seconds(5);
  // Read so that a modules.json written for an earlier module still loads;
  // Status is answered by the module itself since issue 45 (no call).
  Duration status_timeout = Seconds(5);

  // A Watch is one call that ends when a limitation happens; it is opened
  // again at once when it ends without one, and after this pause when the
  // sidecar could not be reached.
  Duration watch_retry_interval = Milliseconds(500);

  // The settings the parameters give, the defaults for those not given. An
  // unknown parameter, an empty socket or a duration that is not positive is
  // an error: the agent does not start with a module it misread.
  static Try<Settings> parse(const mesos::Parameters& parameters);

  // The gRPC target the module's channel connects to ("unix:<path>").
  std::string address() const;
};

} // namespace gpu_isolator {

#endif // GPU_ISOLATOR_MESOS_SETTINGS_HPP
