# Registers logon scheduled tasks for the moed daemon and tray for the current user
# (written by `moed service install`). Run:   powershell -ExecutionPolicy Bypass -File install-moed.ps1
# Remove them:                               powershell -ExecutionPolicy Bypass -File install-moed.ps1 -Uninstall
param([switch]$Uninstall)
$ErrorActionPreference = 'Stop'

$Moed = '@MOED@'
$MoedTray = '@MOED_TRAY@'
$Tasks = @('moed daemon', 'moed tray')

if ($Uninstall) {
    foreach ($name in $Tasks) {
        if (Get-ScheduledTask -TaskName $name -ErrorAction SilentlyContinue) {
            Stop-ScheduledTask -TaskName $name -ErrorAction SilentlyContinue
            Unregister-ScheduledTask -TaskName $name -Confirm:$false
            Write-Host "removed logon task '$name'"
        }
    }
    exit 0
}

foreach ($exe in @($Moed, $MoedTray)) {
    if (-not (Test-Path -LiteralPath $exe)) {
        throw "moed executable not found: $exe (reinstall moed, then run 'moed service install' again)"
    }
}

$user = [System.Security.Principal.WindowsIdentity]::GetCurrent().Name
$trigger = New-ScheduledTaskTrigger -AtLogOn -User $user
$principal = New-ScheduledTaskPrincipal -UserId $user -LogonType Interactive -RunLevel Limited
# no time limit; restart the daemon if it fails
$settings = New-ScheduledTaskSettingsSet -AllowStartIfOnBatteries -DontStopIfGoingOnBatteries `
    -ExecutionTimeLimit ([TimeSpan]::Zero) -RestartCount 3 -RestartInterval (New-TimeSpan -Minutes 1)

$daemon = New-ScheduledTaskAction -Execute $Moed -Argument 'serve'
Register-ScheduledTask -TaskName 'moed daemon' -Action $daemon -Trigger $trigger -Principal $principal `
    -Settings $settings -Description 'moed: local daemon serving Mixture-of-Experts models' -Force | Out-Null

$tray = New-ScheduledTaskAction -Execute $MoedTray
Register-ScheduledTask -TaskName 'moed tray' -Action $tray -Trigger $trigger -Principal $principal `
    -Settings $settings -Description 'moed tray menu' -Force | Out-Null

Start-ScheduledTask -TaskName 'moed daemon'
Start-ScheduledTask -TaskName 'moed tray'
Write-Host "registered logon tasks 'moed daemon' and 'moed tray' for $user (started now)"
