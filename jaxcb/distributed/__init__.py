"""Data-parallel engine replicas on Ray: JSONL jobs split across replicas (`ray_jobs`) and one
OpenAI endpoint in front of several engines (`ray_server`). Ray is the optional `[dist]` extra;
nothing here is imported unless a `backend=ray` is asked for."""
