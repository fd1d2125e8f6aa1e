"""Running the product: the `pdd` CLI, status, fault injection, the local cluster, KubeRay
manifests, HAProxy, and progress bars for long work."""
