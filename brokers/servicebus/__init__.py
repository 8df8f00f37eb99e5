"""Azure Service Bus broker (``type: servicebus``)."""

from brokers.servicebus._settings import ServiceBusSettings

try:
    from brokers.servicebus._adapter import ServiceBusBroker
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "The Service Bus broker needs the azure-servicebus SDK: "
        "pip install 'outbox-router[servicebus]'"
    ) from exc

__all__ = ["ServiceBusBroker", "ServiceBusSettings"]
