"""Which models swapio has offloaded: every module of an offloaded model -> the streamer or hook that owns it. Its
own module, so that api (which fills it) and chain/grafting (which read it) import it without importing each
other."""
import weakref


class Registry(weakref.WeakKeyDictionary):
    """Every module of an offloaded model -> its streamer or hook, both held weakly. The owner lives as long as the
    model does (the model's forward wrappers and hooks hold it), so a model dropped without remove_offload is
    collected, and its pinned buffers, handle and offload_dir claim go with it."""

    def __setitem__(self, module, owner):
        super().__setitem__(module, weakref.ref(owner))

    def __getitem__(self, module):
        owner = super().__getitem__(module)()
        if owner is None:
            raise KeyError(module)
        return owner

    def get(self, module, default=None):
        try:
            return self[module]
        except KeyError:
            return default


offloaded = Registry()


def register(model, owner):
    for m in model.modules():
        offloaded[m] = owner


def unregister(model, owner):
    for m in model.modules():
        if offloaded.get(m) is owner:
            del offloaded[m]
