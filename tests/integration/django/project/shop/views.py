"""Views that take a lease, fence their writes in a nested atomic block under the
request's transaction, and give the lease back before that transaction commits
(issue 41, defect 4): shop/fence_views.py requests them."""

from django.db import connection, transaction
from django.http import HttpRequest, JsonResponse
from tgsite.celery import app

from shop.models import Invoice
from shop.tasks import write_invoice
from taskguard.config import guard_for


@transaction.atomic
def fenced_invoice(request: HttpRequest, number: str) -> JsonResponse:
    guard = guard_for(app)
    lease = guard.acquire(f"invoice:{number}", ttl=30, task_name="shop.view")
    assert lease is not None
    with transaction.atomic():  # a savepoint inside the request's transaction
        token = lease.fence(connection)
        Invoice.objects.create(number=number, token=token)
    released = guard.release(lease)  # before the request's transaction commits
    Invoice.objects.create(number=f"{number}-after", token=token)
    if request.GET.get("fail"):
        raise RuntimeError("the view failed after its release")
    return JsonResponse({"token": token, "released": released})


@transaction.atomic
def eager_task(request: HttpRequest, number: str) -> JsonResponse:
    """A guarded task run eagerly inside the request's transaction: its fence is in
    its own atomic block, its release at the end of the run."""
    token = write_invoice.apply(args=(number,)).get()
    Invoice.objects.create(number=f"{number}-after", token=token)
    return JsonResponse({"token": token})


@transaction.atomic
def released_in_a_failed_block(request: HttpRequest, number: str) -> JsonResponse:
    """The release is called inside the nested block, which then rolls back to its
    savepoint; the request's transaction goes on and commits."""
    guard = guard_for(app)
    lease = guard.acquire(f"invoice:{number}", ttl=30, task_name="shop.view")
    assert lease is not None
    try:
        with transaction.atomic():
            Invoice.objects.create(number=number, token=lease.fence(connection))
            guard.release(lease)
            raise ValueError("the block failed")
    except ValueError:
        pass
    Invoice.objects.create(number=f"{number}-after", token=lease.token)
    return JsonResponse({"token": lease.token})
