from django.db import models


class Invoice(models.Model):
    """Business data written under a fenced lease."""

    number = models.CharField(max_length=40)
    token = models.BigIntegerField()
