"""How a round's replies arrive: the policies of the collection (:mod:`.base`)."""

from lightning_fl.federated.arrivals.base import Arrivals, Delivery, WaitForAll, local_steps
from lightning_fl.federated.arrivals.buffered import Buffered, Flight
from lightning_fl.federated.arrivals.timed import Timed, layout_bytes

__all__ = ["Arrivals", "Buffered", "Delivery", "Flight", "Timed", "WaitForAll", "layout_bytes", "local_steps"]
