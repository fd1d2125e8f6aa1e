"""One engine replica and what reaches it: the vLLM engine a role runs (replica), the role
deployments, the token channel streams use, sampling state carried across engines, the KV
connector and links (kv/), and the link emulators' deployments."""
