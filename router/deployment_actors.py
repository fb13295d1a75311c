"""Small named Ray actors that belong to one deployment of an app and outlive its router process (a router Serve
restarts after a crash finds them): the LoRA ledger, the stored responses. A new deployment ends the earlier
deployments' ones."""

import ray


def deployment_actor(actor_class, prefix: str, app: str, deployment_id: str, *args):
    """This deployment's actor of `actor_class` under `prefix` (the first router makes it), ending the app's earlier
    deployments' actors of that prefix."""
    name = f"{prefix}:{app}:{deployment_id}"
    for actor in ray.util.list_named_actors(all_namespaces=True):
        if actor["name"].startswith(f"{prefix}:{app}:") and actor["name"] != name:
            ray.kill(ray.get_actor(actor["name"], namespace=actor["namespace"]))
    return actor_class.options(name=name, lifetime="detached", get_if_exists=True).remote(*args)
