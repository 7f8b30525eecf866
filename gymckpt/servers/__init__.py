"""The reference servers: one FastAPI app per kind of server a Gym stack has, each checkpointable.

The kinds (``gymckpt serve KIND``; :data:`gymckpt.stack.KINDS` maps each to its module):

- ``inference`` (:mod:`~gymckpt.servers.inference`): the fake inference backend, deterministic
  tokens produced slowly and a log of completed calls; not a Gym server (no checkpoint routes);
- ``model`` (:mod:`~gymckpt.servers.model`): the policy model server, OpenAI Responses-style
  ``/v1/responses`` in front of the inference backend;
- ``agent`` (:mod:`~gymckpt.servers.agent`): the simple agent, a turn loop of model call → tool call;
- ``counter`` (:mod:`~gymckpt.servers.counter`): a resources server whose exported session
  state is required for the right reward;
- ``weather`` (:mod:`~gymckpt.servers.weather`): a resources server with stateless tools and a
  verification that may run again;
- ``sandbox`` (:mod:`~gymckpt.servers.sandbox`): a resources server whose sessions are big (a file
  tree and a command history, 350 KB by default), exported and restored without copies;
- ``environment`` (:mod:`~gymckpt.servers.environment`): a single-turn environment server, seed,
  invoke the agent, close it, verify, return.

:mod:`gymckpt.servers.base` holds what they share: the config, the app, the downstream client.
Running them as processes, one by one or as a whole stack, and driving a stack as a
controller would, is :mod:`gymckpt.stack`'s job; nothing in this package imports it.
"""
