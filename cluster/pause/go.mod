// The pod sandbox's process for the real node (containerd's `sandbox_image`): no registry is
// reachable here, so the image is built from this program. Standard library only.
module finetune-operator/cluster/pause

go 1.26.0
