"""A guarded task that writes business data under a fenced lease."""

from django.db import connection, transaction
from tgsite.celery import app

from shop.models import Invoice
from taskguard import current_lease, guarded_task


@guarded_task(app=app, key="invoice:{number}", ttl=30)
def write_invoice(number: str) -> int:
    with transaction.atomic():
        lease = current_lease()
        assert lease is not None
        token = lease.fence(connection)
        Invoice.objects.create(number=number, token=token)
    return token
