// The module's registration: the agent finds `org_gpuisolator_GpuIsolator`
// in this library (--modules) and names it in --isolation. Parameters are
// parsed once; a bad one stops the agent.

#include <mesos/mesos.hpp>
#include <mesos/module.hpp>
#include <mesos/module/isolator.hpp>
#include <mesos/slave/isolator.hpp>

#include <glog/logging.h>

#include "gpu_isolator.hpp"
#include "settings.hpp"

namespace {

mesos::slave::Isolator* create(const mesos::Parameters& parameters)
{
  Try<gpu_isolator::Settings> settings =
    gpu_isolator::Settings::parse(parameters);
  if (settings.isError()) {
    LOG(ERROR) << "gpu-isolator module: " << settings.error();
    return nullptr;
  }
  LOG(INFO) << "gpu-isolator module: forwarding every isolator hook to the"
            << " sidecar at '" << settings->address() << "'";
  return new gpu_isolator::GpuIsolator(settings.get());
}

} // namespace {


mesos::modules::Module<mesos::slave::Isolator> org_gpuisolator_GpuIsolator(
    MESOS_MODULE_API_VERSION,
    MESOS_VERSION,
    "gpu-isolator",
    "https://github.com/gpu-isolator",
    "GPU isolation by the gpu-isolator sidecar: each hook forwarded over its"
    " gRPC socket.",
    nullptr,
    create);
