"""One fenced row per account: the value last written, every token accepted in order."""

from __future__ import annotations

from django.db import models

from celery_redlock.fencing.django import FencedQuerySet, FenceField


class Account(models.Model):
    name = models.CharField(max_length=100, primary_key=True)
    value = models.TextField(default="")
    history = models.TextField(default="")
    fence = FenceField()

    objects = FencedQuerySet.as_manager()
