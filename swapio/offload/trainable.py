"""TrainableOwner: what an owner of trainable offloaded weights implements, and when swapio.offload calls it.

An offloaded model's trainable weights are updated by whoever claims them (Training.claim in training.py):
swapio.optim's offloaded optimizers do, through their OffloadedParams. swapio.offload knows the owner only
through this class (the way accelerate's hooks know a ModelHook): a gradient arrives, a forward is about to read
the weights, a backward needs them, the model goes back to resident weights. Every method is documented here
with what swapio.offload guarantees when it calls it; the defaults do nothing, except gradient(), which an owner
must take (dropping a gradient silently would leave the weight untrained).

The other direction, what an owner may call on the model's side, is Training's public methods (training.py):
claim/release, begin/end/abort of a record's rewrite, flush, the order of records, current values, pinned memory,
and report(error): an owner going away hands over an error about its updates it can no longer raise, which the
next forward or remove_offload raises.
"""


class TrainableOwner:
    """The base of an owner of trainable offloaded weights (see the module). Subclass it and override what the
    owner needs; swapio.offload calls nothing else on it."""

    def gradient(self, slot, grad, complete, backward):
        """The gradient `grad` of one use of the offloaded weight `slot` arrived, on the backward thread, right
        after autograd accumulated it (the leaf's .grad is dropped already). grad is on the execution device as
        autograd made it; backward: an id of the backward it belongs to (backwards may overlap: threads, a
        reentrant checkpoint's); complete: no other use of the slot waits for its gradient in this backward (a
        weight used several times in one forward gets one call per use). Raising here fails the backward."""
        raise NotImplementedError(f"{type(self).__name__} owns offloaded weights but takes no gradients: "
                                  "override TrainableOwner.gradient")

    def backward_ended(self, slot, backward):
        """The backward ended before every use of `slot` got a gradient (a loss computed from one of several
        forwards): the uses that got one are the slot's gradient of this backward, as .grad gets at each backward's
        end. gradient() was called with complete=False for each of them."""

    def backward_abandoned(self, slot, backward):
        """The backward raised; it had brought gradients of `slot` (called for each such slot). The uses gradient()
        got with complete=False in it are no gradient, as autograd drops a leaf's inputs it had not yet
        accumulated; those given with complete=True stay as they were taken."""

    def settle(self):
        """A forward is about to read the model's weights: updates the owner still runs on its own threads (from
        the last backward) finish first, so the forward reads the new weights. An owner whose updates run during
        backward keeps what they need alive until they finish, even if the program drops it meanwhile."""

    def check_backward(self, record):
        """A backward needs the weights of `record` (an offloaded module's backward refetches them): raise
        RuntimeError if the owner has already updated them in this backward (a second backward of one graph)."""

    def flush(self):
        """remove_offload() is about to make the weights resident again: updates still running and the writes of
        the new weights finish first, so the model comes back as the last step left it."""
