"""Azure Service Bus broker (``type: servicebus``); the adapter and its SDK load on first use."""

from typing import TYPE_CHECKING

from brokers._lazy import adapter_getattr
from brokers.servicebus._settings import ServiceBusSettings

if TYPE_CHECKING:
    from brokers.servicebus._adapter import ServiceBusBroker

__all__ = ["ServiceBusBroker", "ServiceBusSettings"]

__getattr__ = adapter_getattr(
    __name__,
    {"ServiceBusBroker": ServiceBusSettings.adapter},
    kind="servicebus",
    extra=ServiceBusSettings.extra,
)
