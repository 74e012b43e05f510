from __future__ import annotations

from typing import ClassVar

from django.db import migrations, models

import celery_redlock.fencing.django


class Migration(migrations.Migration):
    initial = True

    dependencies: ClassVar[list[tuple[str, str]]] = []

    operations: ClassVar[list[migrations.operations.base.Operation]] = [
        migrations.CreateModel(
            name="Account",
            fields=[
                (
                    "name",
                    models.CharField(max_length=100, primary_key=True, serialize=False),
                ),
                ("value", models.TextField(default="")),
                ("history", models.TextField(default="")),
                ("fence", celery_redlock.fencing.django.FenceField(default=0)),
            ],
        ),
    ]
