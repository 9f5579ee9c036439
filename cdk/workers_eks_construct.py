"""Workers on EKS: a GPU managed node group, the worker Deployment with an IRSA
service account, KEDA scaling on queue backlog, and the Cluster Autoscaler so
that GPU nodes follow the pods down to zero."""

from __future__ import annotations

from aws_cdk import CfnJson, Stack
from aws_cdk import aws_ec2 as ec2
from aws_cdk import aws_ecr_assets as ecr_assets
from aws_cdk import aws_eks as eks_l1
from aws_cdk import aws_eks_v2 as eks
from aws_cdk import aws_iam as iam
from aws_cdk import aws_kms as kms
from aws_cdk import aws_logs as logs
from aws_cdk.lambda_layer_kubectl_v35 import KubectlV35Layer
from constructs import Construct

from cdk import access
from cdk.config import PRIORITIES, SluiceConfig
from cdk.log_retention import LOG_RETENTION, expire_service_log_group
from cdk.queues_construct import Queues
from cdk.storage_construct import Storage
from sluice.worker.metrics import NAMESPACE as METRICS_NAMESPACE

NAMESPACE = "sluice"
WORKER = "sluice-worker"
GPU_TAINT = "nvidia.com/gpu"


class EksWorkers(Construct):
    def __init__(
        self,
        scope: Construct,
        id: str,
        *,
        config: SluiceConfig,
        image: ecr_assets.DockerImageAsset,
        storage: Storage,
        queues: Queues,
    ) -> None:
        super().__init__(scope, id)
        region = Stack.of(self).region

        self.vpc = ec2.Vpc(
            self,
            "Vpc",
            max_azs=2,
            nat_gateways=1,  # nodes pull images and reach SQS/DynamoDB/S3 through it
            subnet_configuration=[
                ec2.SubnetConfiguration(name="public", subnet_type=ec2.SubnetType.PUBLIC, cidr_mask=24),
                ec2.SubnetConfiguration(name="private", subnet_type=ec2.SubnetType.PRIVATE_WITH_EGRESS, cidr_mask=19),
            ],
            flow_logs={
                "all": ec2.FlowLogOptions(
                    destination=ec2.FlowLogDestination.to_cloud_watch_logs(
                        logs.LogGroup(self, "FlowLogs", retention=LOG_RETENTION)
                    )
                )
            },
        )
        # Data-plane traffic to S3 and DynamoDB skips the NAT gateway.
        self.vpc.add_gateway_endpoint("S3", service=ec2.GatewayVpcEndpointAwsService.S3)
        self.vpc.add_gateway_endpoint("DynamoDb", service=ec2.GatewayVpcEndpointAwsService.DYNAMODB)

        self.cluster = eks.Cluster(
            self,
            "Cluster",
            version=eks.KubernetesVersion.of(config.kubernetes_version),
            vpc=self.vpc,
            vpc_subnets=[ec2.SubnetSelection(subnet_type=ec2.SubnetType.PRIVATE_WITH_EGRESS)],
            endpoint_access=eks.EndpointAccess.PRIVATE,
            default_capacity_type=eks.DefaultCapacityType.NODEGROUP,
            default_capacity=0,
            cluster_logging=[
                eks.ClusterLoggingTypes.API,
                eks.ClusterLoggingTypes.AUDIT,
                eks.ClusterLoggingTypes.AUTHENTICATOR,
                eks.ClusterLoggingTypes.CONTROLLER_MANAGER,
                eks.ClusterLoggingTypes.SCHEDULER,
            ],
            secrets_encryption_key=kms.Key(self, "SecretsKey", enable_key_rotation=True),
            kubectl_provider_options=eks.KubectlProviderOptions(kubectl_layer=KubectlV35Layer(self, "Kubectl")),
        )
        cluster = self.cluster
        # Where EKS sends the control-plane logs enabled above.
        expire_service_log_group(
            self, "ControlPlaneLogRetention", log_group_name=f"/aws/eks/{cluster.cluster_name}/cluster"
        )

        # Small on-demand nodes for CoreDNS, KEDA and the autoscaler; the GPU
        # nodes are tainted so that only workers land there.
        self.system_nodes = cluster.add_nodegroup_capacity(
            "System",
            instance_types=[ec2.InstanceType("m6i.large")],
            ami_type=eks.NodegroupAmiType.BOTTLEROCKET_X86_64,
            min_size=2,
            max_size=3,
            labels={"sluice/role": "system"},
        )
        # Bottlerocket's NVIDIA variant ships the driver and the device plugin.
        self.gpu_nodes = cluster.add_nodegroup_capacity(
            "Gpu",
            instance_types=[ec2.InstanceType(t) for t in config.gpu_instance_types],
            ami_type=eks.NodegroupAmiType.BOTTLEROCKET_X86_64_NVIDIA,
            min_size=config.min_nodes,
            desired_size=config.min_nodes,
            max_size=config.max_nodes,
            disk_size=100,
            # The accelerator label tells the Cluster Autoscaler a new node's GPUs
            # are not ready until the device plugin reports them, so a scale-up
            # from zero does not add a second node while the first boots.
            labels={"sluice/role": "gpu-worker", "k8s.amazonaws.com/accelerator": "nvidia"},
            taints=[eks.TaintSpec(effect=eks.TaintEffect.NO_SCHEDULE, key=GPU_TAINT, value="true")],
        )

        namespace = cluster.add_manifest(
            "Namespace", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}}
        )

        # ---------------------------------------------------------- worker
        # IRSA through the IAM-native OIDC provider (no custom resource).
        self.oidc = eks.OidcProviderNative(self, "Oidc", url=cluster.cluster_open_id_connect_issuer_url)
        self.worker_role = self._irsa_role("WorkerRole", NAMESPACE, WORKER)
        queues.grant(self.worker_role, sorted(set(access.WORKER_QUEUES + access.SETTLE_QUEUES)))
        queues.grant_dlqs(self.worker_role, sorted(set(access.SETTLE_DLQS + access.DEAD_LETTER_DLQS)))
        storage.grant_tasks(self.worker_role, sorted(set(access.WORKER_TASKS + access.SETTLE_TASKS)))
        storage.grant_inputs(self.worker_role, access.WORKER_INPUTS)
        storage.grant_results(self.worker_role, access.WORKER_RESULTS)
        storage.grant_bucket(self.worker_role, access.WORKER_BUCKET)
        self.worker_role.add_to_policy(
            iam.PolicyStatement(
                actions=access.WORKER_METRICS,
                resources=["*"],  # PutMetricData takes no resource
                conditions={"StringEquals": {"cloudwatch:namespace": METRICS_NAMESPACE}},
            )
        )
        service_account = {
            "apiVersion": "v1",
            "kind": "ServiceAccount",
            "metadata": {
                "name": WORKER,
                "namespace": NAMESPACE,
                "annotations": {"eks.amazonaws.com/role-arn": self.worker_role.role_arn},
            },
        }

        labels = {"app.kubernetes.io/name": WORKER}
        env = {
            "AWS_REGION": region,
            "SLUICE_REGION": region,
            "SLUICE_TASKS_TABLE": storage.tasks.table_name,
            "SLUICE_BUCKET": storage.bucket.bucket_name,
            "SLUICE_QUEUE_PREFIX": config.name_prefix,
            "SLUICE_MODELS": config.models,
            "SLUICE_MAX_BATCH_SIZE": str(config.max_batch_size),
            "SLUICE_MAX_WAIT_MS": str(config.max_wait_ms),
            "SLUICE_VISIBILITY_TIMEOUT_S": str(config.visibility_timeout_s),
            "SLUICE_INFERENCE_TIMEOUT_S": str(config.inference_timeout_s),
            **config.lifecycle_env,
            "SLUICE_DEVICE": "cuda",
            # The add-on ships container logs, not EMF: EMF lines on stdout would never become metrics.
            "SLUICE_METRICS_SINK": "cloudwatch",
            **queues.env(),
        }
        deployment = {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": WORKER, "namespace": NAMESPACE, "labels": labels},
            "spec": {
                # No replicas: KEDA owns the count (it starts at zero).
                "selector": {"matchLabels": labels},
                # Replace in place, as the on-prem manifest does: at max_workers every
                # GPU node is taken, and a surge pod would wait for a node the
                # autoscaler may not add (max_nodes), stalling the rollout.
                "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 1, "maxSurge": 0}},
                "template": {
                    "metadata": {"labels": labels},
                    "spec": {
                        "serviceAccountName": WORKER,
                        # SIGTERM -> finish the batch in hand -> exit; never cut short.
                        "terminationGracePeriodSeconds": config.termination_grace_s,
                        # The image runs as uid 10001 (numeric, so the kubelet can verify it).
                        "securityContext": {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}},
                        "nodeSelector": {"sluice/role": "gpu-worker"},
                        "tolerations": [{"key": GPU_TAINT, "operator": "Equal", "value": "true", "effect": "NoSchedule"}],
                        "containers": [
                            {
                                "name": "worker",
                                "image": image.image_uri,
                                "env": [{"name": k, "value": v} for k, v in env.items()],
                                "resources": {
                                    "requests": {"cpu": "2", "memory": "8Gi", "nvidia.com/gpu": "1"},
                                    "limits": {"memory": "12Gi", "nvidia.com/gpu": "1"},
                                },
                                "securityContext": {
                                    "allowPrivilegeEscalation": False,
                                    "capabilities": {"drop": ["ALL"]},
                                },
                            }
                        ],
                    },
                },
            },
        }
        pdb = {
            "apiVersion": "policy/v1",
            "kind": "PodDisruptionBudget",
            "metadata": {"name": WORKER, "namespace": NAMESPACE},
            # Drains take one worker at a time; each finishes its batch first.
            "spec": {"maxUnavailable": 1, "selector": {"matchLabels": labels}},
        }
        workload = cluster.add_manifest("Worker", service_account, deployment, pdb)
        workload.node.add_dependency(namespace)

        # ------------------------------------------------------------ KEDA
        keda_role = self._irsa_role("KedaOperatorRole", "keda", "keda-operator")
        # KEDA only reads queue depth.
        iam.Grant.add_to_principal(
            grantee=keda_role,
            actions=["sqs:GetQueueAttributes"],
            resource_arns=[q.queue_arn for q in queues.queues.values()],
        )
        keda = cluster.add_helm_chart(
            "Keda",
            chart="keda",
            repository="https://kedacore.github.io/charts",
            version=config.keda_chart_version,
            namespace="keda",
            release="keda",
            values={
                "podIdentity": {"aws": {"irsa": {"enabled": True, "roleArn": keda_role.role_arn}}},
                "nodeSelector": {"sluice/role": "system"},
            },
            wait=True,
        )
        # Charts and add-ons wait for their pods, which need the system nodes.
        keda.node.add_dependency(self.system_nodes)
        trigger_auth = {
            "apiVersion": "keda.sh/v1alpha1",
            "kind": "TriggerAuthentication",
            "metadata": {"name": "sluice-aws", "namespace": NAMESPACE},
            "spec": {"podIdentity": {"provider": "aws"}},
        }
        scaled_object = {
            "apiVersion": "keda.sh/v1alpha1",
            "kind": "ScaledObject",
            "metadata": {"name": WORKER, "namespace": NAMESPACE},
            "spec": {
                "scaleTargetRef": {"name": WORKER},
                "minReplicaCount": config.min_workers,
                "maxReplicaCount": config.max_workers,
                "pollingInterval": 15,
                "cooldownPeriod": 300,
                "triggers": [
                    {
                        "type": "aws-sqs-queue",
                        "name": f"backlog-{priority}",
                        "authenticationRef": {"name": "sluice-aws"},
                        "metadata": {
                            "queueURL": queues.queues[priority].queue_url,
                            "queueLength": str(config.messages_per_worker),
                            "awsRegion": region,
                            # In-flight messages are work in hand: keep their workers.
                            "scaleOnInFlight": "true",
                        },
                    }
                    for priority in PRIORITIES
                ],
            },
        }
        scaling = cluster.add_manifest("WorkerScaling", trigger_auth, scaled_object)
        scaling.node.add_dependency(keda)
        scaling.node.add_dependency(workload)

        # ------------------------------------------------ cluster autoscaler
        autoscaler_role = self._irsa_role("ClusterAutoscalerRole", "kube-system", "cluster-autoscaler")
        autoscaler_role.add_to_policy(
            iam.PolicyStatement(
                actions=[
                    "autoscaling:DescribeAutoScalingGroups",
                    "autoscaling:DescribeAutoScalingInstances",
                    "autoscaling:DescribeLaunchConfigurations",
                    "autoscaling:DescribeScalingActivities",
                    "autoscaling:DescribeTags",
                    "ec2:DescribeImages",
                    "ec2:DescribeInstanceTypes",
                    "ec2:DescribeLaunchTemplateVersions",
                    "ec2:GetInstanceTypesFromInstanceRequirements",
                    "eks:DescribeNodegroup",
                ],
                resources=["*"],  # Describe calls take no resource
            )
        )
        autoscaler_role.add_to_policy(
            iam.PolicyStatement(
                actions=["autoscaling:SetDesiredCapacity", "autoscaling:TerminateInstanceInAutoScalingGroup"],
                resources=["*"],
                # Only the node groups of this cluster (EKS tags their groups).
                conditions={"StringEquals": {"aws:ResourceTag/eks:cluster-name": cluster.cluster_name}},
            )
        )
        autoscaler = cluster.add_helm_chart(
            "ClusterAutoscaler",
            chart="cluster-autoscaler",
            repository="https://kubernetes.github.io/autoscaler",
            version=config.cluster_autoscaler_chart_version,
            namespace="kube-system",
            release="cluster-autoscaler",
            values={
                "cloudProvider": "aws",
                "awsRegion": region,
                # Supported only against the Kubernetes minor it was built for.
                "image": {"tag": f"v{config.kubernetes_version}.0"},
                "autoDiscovery": {"clusterName": cluster.cluster_name},
                "rbac": {
                    "serviceAccount": {
                        "name": "cluster-autoscaler",
                        "annotations": {"eks.amazonaws.com/role-arn": autoscaler_role.role_arn},
                    }
                },
                "extraArgs": {"balance-similar-node-groups": True, "skip-nodes-with-system-pods": False},
                "nodeSelector": {"sluice/role": "system"},
            },
        )
        autoscaler.node.add_dependency(self.system_nodes)

        # ------------------------------------------- container insights
        # GPU utilization/memory per node and pod, and the worker logs.
        insights_role = self._irsa_role("CloudWatchAgentRole", "amazon-cloudwatch", "cloudwatch-agent")
        insights_role.add_managed_policy(iam.ManagedPolicy.from_aws_managed_policy_name("CloudWatchAgentServerPolicy"))
        insights = eks_l1.CfnAddon(
            self,
            "CloudWatchObservability",
            addon_name="amazon-cloudwatch-observability",
            cluster_name=cluster.cluster_name,
            service_account_role_arn=insights_role.role_arn,
            resolve_conflicts="OVERWRITE",
        )
        insights.node.add_dependency(self.system_nodes)
        # The add-on's Fluent Bit and agent create these with no retention;
        # `application` holds every line every worker logs.
        for kind in ("application", "dataplane", "host", "performance"):
            expire_service_log_group(
                self, f"ContainerInsights{kind.title()}LogRetention",
                log_group_name=f"/aws/containerinsights/{cluster.cluster_name}/{kind}",
            )

    def _irsa_role(self, id: str, namespace: str, service_account: str) -> iam.Role:
        """A role that exactly one Kubernetes service account may assume (IRSA)."""
        provider = self.oidc
        issuer = provider.oidc_provider_issuer
        conditions = CfnJson(
            self,
            f"{id}Conditions",
            value={
                f"{issuer}:sub": f"system:serviceaccount:{namespace}:{service_account}",
                f"{issuer}:aud": "sts.amazonaws.com",
            },
        )
        return iam.Role(
            self,
            id,
            assumed_by=iam.OpenIdConnectPrincipal(provider, conditions={"StringEquals": conditions}),
        )
