// The translation between Mesos's messages and the contract's.

#include <string>
#include <vector>

#include <gtest/gtest.h>

#include <mesos/mesos.hpp>
#include <mesos/resources.hpp>
#include <mesos/slave/isolator.hpp>

#include "translate.hpp"

namespace v1 = gpuisolator::v1;

using gpu_isolator::codeName;
using gpu_isolator::containerRequest;
using gpu_isolator::isolateFailure;
using gpu_isolator::isolateRequest;
using gpu_isolator::launchInfoOf;
using gpu_isolator::limitationOf;
using gpu_isolator::prepareRequest;
using gpu_isolator::recoverRequest;
using gpu_isolator::statisticsOf;
using gpu_isolator::updateReads;
using gpu_isolator::updateRequest;
using gpu_isolator::wireName;

namespace {

mesos::ContainerID nested(const std::string& parent, const std::string& child)
{
  mesos::ContainerID id;
  id.set_value(child);
  id.mutable_parent()->set_value(parent);
  return id;
}

} // namespace {


TEST(TranslateTest, AContainerRequestKeepsTheParentChain)
{
  Try<v1::CleanupRequest> request =
    containerRequest<v1::CleanupRequest>(nested("a", "b"));
  ASSERT_FALSE(request.isError()) << request.error();
  EXPECT_EQ("b", request->container_id().value());
  EXPECT_EQ("a", request->container_id().parent().value());
  EXPECT_FALSE(request->container_id().parent().has_parent());
}


TEST(TranslateTest, PrepareKeepsTheContractsFieldsAndDropsTheRest)
{
  mesos::slave::ContainerConfig config;
  config.set_directory("/sandbox");
  config.set_user("nobody");
  Try<mesos::Resources> resources =
    mesos::Resources::parse("cpus:1;mem:32;gpus:2");
  ASSERT_FALSE(resources.isError()) << resources.error();
  config.mutable_resources()->CopyFrom(resources.get());

  Try<v1::PrepareRequest> request = prepareRequest(nested("a", "b"), config);
  ASSERT_FALSE(request.isError()) << request.error();
  EXPECT_EQ("b", request->container_id().value());
  const v1::ContainerConfig& contract = request->container_config();
  ASSERT_EQ(3, contract.resources_size());
  double gpus = 0;
  for (const v1::Resource& resource : contract.resources()) {
    if (resource.name() == "gpus") {
      gpus = resource.scalar().value();
    }
  }
  EXPECT_EQ(2.0, gpus);
  // Nothing the contract does not define travels to the sidecar.
  EXPECT_EQ(
      0u, contract.GetReflection()->GetUnknownFields(contract).field_count());
}


TEST(TranslateTest, IsolateCarriesThePid)
{
  Try<v1::IsolateRequest> request = isolateRequest(nested("a", "b"), 4242);
  ASSERT_FALSE(request.isError()) << request.error();
  EXPECT_EQ(4242u, request->pid());
}


TEST(TranslateTest, UpdateCarriesTheRequestedResources)
{
  Try<mesos::Resources> resources = mesos::Resources::parse("gpus:1");
  ASSERT_FALSE(resources.isError()) << resources.error();
  Try<v1::UpdateRequest> request =
    updateRequest(nested("a", "b"), resources.get());
  ASSERT_FALSE(request.isError()) << request.error();
  ASSERT_EQ(1, request->resource_requests_size());
  EXPECT_EQ("gpus", request->resource_requests(0).name());
  EXPECT_EQ(1.0, request->resource_requests(0).scalar().value());
}


namespace {

// The contract's resources of an Update built from Mesos's text form.
google::protobuf::RepeatedPtrField<v1::Resource> contract(const char* text)
{
  Try<mesos::Resources> resources = mesos::Resources::parse(text);
  EXPECT_FALSE(resources.isError()) << resources.error();
  Try<v1::UpdateRequest> request =
    updateRequest(nested("a", "b"), resources.get());
  EXPECT_FALSE(request.isError()) << request.error();
  return request->resource_requests();
}

const std::vector<std::string> READS = {"gpus", "gpu_shares", "mig-*"};

} // namespace {


TEST(TranslateTest, UpdateReadsIgnoresWhatTheSidecarDoesNotActOn)
{
  // The executor's registration changes cpus and mem only: nothing to send.
  EXPECT_EQ(
      updateReads(contract("cpus:0.1;mem:32;gpus:1"), READS),
      updateReads(contract("cpus:1.1;mem:160;gpus:1;disk:10"), READS));
  // A name that only starts like one read is not read; a prefix is.
  EXPECT_EQ(
      updateReads(contract("gpus:1"), READS),
      updateReads(contract("gpus:1;gpusx:3;gpu_shares_x:2"), READS));
  EXPECT_NE(
      updateReads(contract("gpus:1"), READS),
      updateReads(contract("gpus:1;mig-1g.10gb:1"), READS));
  // The order of the resources and their roles aside.
  EXPECT_EQ(
      updateReads(contract("gpu_shares:2;gpus:1"), READS),
      updateReads(contract("gpus(role1):1;gpu_shares:2"), READS));
}


TEST(TranslateTest, UpdateReadsSeesEachChangeOfWhatTheSidecarActsOn)
{
  const std::vector<std::string> one = updateReads(contract("gpus:1"), READS);
  EXPECT_NE(one, updateReads(contract("gpus:2"), READS));
  EXPECT_NE(one, updateReads(contract("cpus:1"), READS));  // gpus gone
  EXPECT_NE(
      updateReads(contract("gpu_shares:2"), READS),
      updateReads(contract("gpu_shares:3"), READS));
  EXPECT_NE(
      updateReads(contract("mig-1g.10gb:1"), READS),
      updateReads(contract("mig-2g.20gb:1"), READS));
  // Nothing named: nothing compares equal to a list with something in it.
  EXPECT_TRUE(updateReads(contract("gpus:1"), {}).empty());
}


TEST(TranslateTest, RecoverCarriesStatesAndOrphans)
{
  mesos::slave::ContainerState state;
  state.mutable_container_id()->set_value("c1");
  state.set_pid(7);
  state.set_directory("/sandbox");
  hashset<mesos::ContainerID> orphans;
  orphans.insert(nested("p", "o"));

  Try<v1::RecoverRequest> request = recoverRequest({state}, orphans);
  ASSERT_FALSE(request.isError()) << request.error();
  ASSERT_EQ(1, request->states_size());
  EXPECT_EQ("c1", request->states(0).container_id().value());
  EXPECT_EQ(7u, request->states(0).pid());
  ASSERT_EQ(1, request->orphans_size());
  EXPECT_EQ("o", request->orphans(0).value());
}


TEST(TranslateTest, NoLaunchInfoIsNone)
{
  Try<Option<mesos::slave::ContainerLaunchInfo>> info =
    launchInfoOf(v1::PrepareResponse());
  ASSERT_FALSE(info.isError()) << info.error();
  EXPECT_TRUE(info->isNone());
}


TEST(TranslateTest, TheLaunchInfoBecomesMesoss)
{
  v1::PrepareResponse response;
  v1::Environment::Variable* variable =
    response.mutable_launch_info()->mutable_environment()->add_variables();
  variable->set_name("NVIDIA_VISIBLE_DEVICES");
  variable->set_value("GPU-1");

  Try<Option<mesos::slave::ContainerLaunchInfo>> info =
    launchInfoOf(response);
  ASSERT_FALSE(info.isError()) << info.error();
  ASSERT_TRUE(info->isSome());
  ASSERT_EQ(1, info->get().environment().variables_size());
  EXPECT_EQ(
      "NVIDIA_VISIBLE_DEVICES",
      info->get().environment().variables(0).name());
  EXPECT_EQ("GPU-1", info->get().environment().variables(0).value());
}


TEST(TranslateTest, StatisticsWithoutATimestampAreRefused)
{
  // Mesos requires ResourceStatistics.timestamp; proto3 leaves a zero off.
  Try<mesos::ResourceStatistics> statistics =
    statisticsOf(v1::UsageResponse());
  ASSERT_TRUE(statistics.isError());
  EXPECT_NE(std::string::npos, statistics.error().find("timestamp"))
    << statistics.error();

  v1::UsageResponse response;
  response.mutable_statistics()->set_timestamp(1.5);
  statistics = statisticsOf(response);
  ASSERT_FALSE(statistics.isError()) << statistics.error();
  EXPECT_EQ(1.5, statistics->timestamp());
}


TEST(TranslateTest, ALimitationGetsTheScalarTypeProto3LeftOut)
{
  v1::WatchResponse response;
  response.mutable_limitation()->set_message("GPU lost");
  v1::Resource* resource = response.mutable_limitation()->add_resources();
  resource->set_name("gpus");
  resource->mutable_scalar()->set_value(1);

  Try<mesos::slave::ContainerLimitation> limitation =
    limitationOf(response);
  ASSERT_FALSE(limitation.isError()) << limitation.error();
  EXPECT_EQ("GPU lost", limitation->message());
  ASSERT_EQ(1, limitation->resources_size());
  EXPECT_EQ(mesos::Value::SCALAR, limitation->resources(0).type());
  EXPECT_TRUE(limitation->IsInitialized());
}


TEST(TranslateTest, AnAnswerWithoutALimitationIsNoLimitation)
{
  EXPECT_TRUE(limitationOf(v1::WatchResponse()).isError());
}


TEST(TranslateTest, AnUnawaitedIsolatesFailureEndsTheLaunchAsAFailedIsolate)
{
  mesos::slave::ContainerLimitation limitation =
    isolateFailure("c1", "gpu-isolator Isolate: FAILED_PRECONDITION: gone");
  EXPECT_EQ(mesos::TaskStatus::REASON_CONTAINER_LAUNCH_FAILED,
            limitation.reason());
  EXPECT_NE(std::string::npos, limitation.message().find("container c1"));
  EXPECT_NE(std::string::npos,
            limitation.message().find("FAILED_PRECONDITION: gone"));
  EXPECT_EQ(0, limitation.resources_size());
  EXPECT_TRUE(limitation.IsInitialized());
}


TEST(TranslateTest, TheMetadataKeysAreTheContracts)
{
  EXPECT_EQ("gpu-isolator-deadline-ms", wireName(v1::METADATA_KEY_DEADLINE));
  EXPECT_EQ(
      "grpc-retry-pushback-ms", wireName(v1::METADATA_KEY_RETRY_PUSHBACK));
}


TEST(TranslateTest, CodeNamesAreGrpcs)
{
  EXPECT_STREQ("RESOURCE_EXHAUSTED", codeName(grpc::RESOURCE_EXHAUSTED));
  EXPECT_STREQ("UNAVAILABLE", codeName(grpc::UNAVAILABLE));
  EXPECT_STREQ("UNKNOWN", codeName(static_cast<grpc::StatusCode>(99)));
}
